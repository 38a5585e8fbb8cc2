// Drives the official S2 TypeScript SDK (@s2-dev/streamstore) against a 3-node cluster for
// tests/test_s2_typescript.py. Talks with the test over stdin/stdout, one JSON line each way:
//  1. creates the basin S2_BASIN and the stream "events" through S2_ENDPOINT_A, prints
//     {"phase":"created"} and reads {"append": URL, "read": URL} (two nodes that are not the
//     stream's primary, chosen by the test);
//  2. appends through the first (forwarded to the primary): a unary append of 5 records, then an
//     append session of 20 inputs; checks the tail and reads everything through the second;
//  3. with {"failover": true} in that answer, runs an append session through the first node of
//     FAILOVER_INPUTS inputs, input i with matchSeqNum i (S2's way to append exactly once),
//     printing {"phase":"kill"} once KILL_AFTER inputs are acknowledged (the test kills the
//     primary with SIGKILL then) and going on; an input whose session ends with an error is
//     resubmitted in a new session from the tail (412: it was kept; 503: outcome unknown);
//  4. reads the whole stream through the second node and prints one JSON line with all it saw.
import readline from "node:readline";
import { AppendInput, AppendRecord, S2, S2Environment, SeqNumMismatchError } from "@s2-dev/streamstore";

const FAILOVER_INPUTS = 200;
const KILL_AFTER = 60;
const WINDOW = 8;

const lines = readline.createInterface({ input: process.stdin })[Symbol.asyncIterator]();
async function ask(message) {
	console.log(JSON.stringify(message));
	const { value, done } = await lines.next();
	if (done) throw new Error("the test closed stdin");
	return JSON.parse(value);
}

const env = S2Environment.parse();
const basinName = process.env.S2_BASIN;
const client = (url) =>
	new S2({
		...env,
		endpoints: { account: url, basin: url },
		requestTimeoutMillis: 30_000,
		retry: { maxAttempts: 20, appendRetryPolicy: "all" },
	});

const onA = client(process.env.S2_ENDPOINT_A);
await onA.basins.create({ basin: basinName });
await onA.basin(basinName).streams.create({ stream: "events" });
const roles = await ask({ phase: "created" });
const viaB = client(roles.append).basin(basinName).stream("events");
const viaC = client(roles.read).basin(basinName).stream("events");

const record = (body) => AppendRecord.string({ body });
const unary = await viaB.append(AppendInput.create([0, 1, 2, 3, 4].map((i) => record(`u${i}`))));
const session = await viaB.appendSession();
const tickets = [];
for (let i = 0; i < 20; i++) tickets.push(await session.submit(AppendInput.create([record(`s${i}`)])));
const sessionAcks = [];
for (const t of tickets) sessionAcks.push((await t.ack()).start.seqNum);
await session.close();
const tailBefore = (await viaC.checkTail()).tail.seqNum;

async function readAll(stream) {
	const tail = (await stream.checkTail()).tail.seqNum;
	const out = [];
	while (out.length < tail) {
		const batch = await stream.read({ start: { from: { seqNum: out.length } }, stop: { limits: { count: 1000 } } });
		for (const r of batch.records) out.push([r.seqNum, r.body]);
	}
	return out;
}

const result = { unary: [unary.start.seqNum, unary.end.seqNum], sessionAcks, tailBefore };
if (roles.failover) {
	const base = tailBefore;
	const acked = [];
	const errors = [];
	let sessions = 0;
	let killed = false;
	let next = 0;
	while (next < FAILOVER_INPUTS) {
		sessions++;
		const s = await viaB.appendSession();
		const pending = [];
		try {
			for (let i = next; i < FAILOVER_INPUTS; i++) {
				const inp = AppendInput.create([record(`f${i}`)], { matchSeqNum: base + i });
				pending.push([i, await s.submit(inp)]);
				while (pending.length > WINDOW || (i === FAILOVER_INPUTS - 1 && pending.length)) {
					const [j, t] = pending.shift();
					const ack = await t.ack();
					acked.push([j, ack.start.seqNum - base]);
					next = j + 1;
				}
				if (!killed && acked.length >= KILL_AFTER) {
					killed = true;
					result.killedAfter = acked.length;
					console.log(JSON.stringify({ phase: "kill" })); // the test kills the primary now
				}
				await new Promise((r) => setTimeout(r, 2));
			}
			await s.close();
		} catch (e) {
			// 412: a resent input was kept after all; 503 (retries spent): unknown. The tail says
			// where the next input goes (this is the stream's only writer)
			if (!(e instanceof SeqNumMismatchError) && e.status !== 503) throw e;
			next = (await viaC.checkTail()).tail.seqNum - base;
			errors.push(`${e.status} ${e.code} (${acked.length} acked; going on from input ${next})`);
			await s.close().catch(() => {});
		}
	}
	Object.assign(result, { acked, errors, sessions });
}
result.stored = await readAll(viaC);
console.log(JSON.stringify(result));
process.exit(0);
