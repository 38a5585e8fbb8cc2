// Drives the official S2 TypeScript SDK (@s2-dev/streamstore) against a node for
// tests/test_s2_typescript.py: with the root token it issues a token scoped to one stream prefix,
// then with that token runs an append session and a read session, and checks a denial.
// Endpoints and the root token come from S2_ACCOUNT_ENDPOINT, S2_BASIN_ENDPOINT, S2_ACCESS_TOKEN.
// Prints one JSON line with what it saw.
import { AppendInput, AppendRecord, S2, S2Environment } from "@s2-dev/streamstore";

const env = S2Environment.parse();
const basinName = process.env.S2_BASIN;
const root = new S2({ ...env });
const tokenId = `ts-${Date.now()}`;
const issued = await root.accessTokens.issue({
	id: tokenId,
	scope: {
		basins: { exact: basinName },
		streams: { prefix: "ts/" },
		opGroups: { stream: { read: true, write: true } },
		ops: ["create-stream"],
	},
});
const scoped = new S2({ ...env, accessToken: issued.accessToken });
const basin = scoped.basin(basinName);
await basin.streams.create({ stream: "ts/events" });
const stream = basin.stream("ts/events");

const session = await stream.appendSession();
const tickets = [];
for (let i = 0; i < 20; i++) {
	tickets.push(
		await session.submit(
			AppendInput.create([AppendRecord.string({ body: `r${i}`, headers: [["k", `v${i}`]] })]),
		),
	);
}
const acks = [];
for (const t of tickets) acks.push(await t.ack());
await session.close();

const bodies = [];
const reader = await stream.readSession({
	start: { from: { seqNum: 0 } },
	stop: { limits: { count: 20 } },
});
for await (const record of reader) {
	bodies.push(record.body);
}

let denied = null;
try {
	await scoped.basin(basinName).stream("other").append(AppendInput.create([AppendRecord.string({ body: "x" })]));
} catch (e) {
	denied = { status: e.status ?? null, code: e.code ?? null };
}

const locations = await root.locations.list();
const now = Date.now();
const metrics = await root.metrics.basin({
	basin: basinName,
	set: "append-ops",
	start: now - 3600_000,
	end: now,
});
const appendOps = metrics.values
	.flatMap((m) => (m.accumulation ? m.accumulation.values : []))
	.reduce((sum, [, v]) => sum + v, 0);

console.log(
	JSON.stringify({
		locations: locations.map((l) => [l.name, l.isPrivate]),
		appendOps,
		token: issued.accessToken.slice(0, 5),
		ackEnds: acks.map((a) => a.end.seqNum),
		bodies,
		denied,
	}),
);
process.exit(0);
