// Checks the node against what the official TypeScript SDK's cloud suites expect of access tokens,
// metrics, locations and encryption (the suites are not on npm; these are our own checks of the same rules),
// through the SDK from npm. Root token, endpoints and a basin prefix come from the environment
// (S2_ACCESS_TOKEN, S2_ACCOUNT_ENDPOINT, S2_BASIN_ENDPOINT). Prints one JSON line: {failures: [...]}.
import { AppendInput, AppendRecord, S2, S2Environment } from "@s2-dev/streamstore";

const env = S2Environment.parse();
const s2 = new S2({ ...env });
const failures = [];
const rnd = () => Math.random().toString(36).slice(2, 10);

async function check(name, fn) {
	try {
		await fn();
	} catch (e) {
		failures.push(`${name}: ${e && e.message ? e.message : e}`);
	}
}
async function rejects(name, promise, status) {
	try {
		await promise;
		failures.push(`${name}: did not fail`);
	} catch (e) {
		if (status !== undefined && e.status !== status) failures.push(`${name}: status ${e.status}, wanted ${status}`);
	}
}
const limited = (token) => new S2({ ...env, accessToken: token });

const basinA = `ts-token-a-${rnd()}`;
const basinB = `ts-token-b-${rnd()}`;
await s2.basins.create({ basin: basinA });
await s2.basins.create({ basin: basinB });
const streamA = `token-stream-${rnd()}`;
await s2.basin(basinA).streams.create({ stream: streamA });
await s2.basin(basinA).stream(streamA).append(AppendInput.create([AppendRecord.string({ body: "record" })]));

// Access tokens: list, prefix, limit, pagination.
const prefix = `ts-page-${rnd()}`;
for (const s of ["a", "b", "c"]) await s2.accessTokens.issue({ id: `${prefix}-${s}`, scope: { ops: ["list-basins"] } });
await check("list by prefix", async () => {
	const ids = (await s2.accessTokens.list({ prefix })).accessTokens.map((t) => t.id);
	if (ids.join() !== [`${prefix}-a`, `${prefix}-b`, `${prefix}-c`].join()) throw new Error(ids.join());
});
await check("paginate", async () => {
	const page1 = await s2.accessTokens.list({ prefix, limit: 2 });
	const last = page1.accessTokens.at(-1).id;
	const page2 = await s2.accessTokens.list({ prefix, startAfter: last, limit: 2 });
	if (!page1.hasMore || page2.accessTokens.map((t) => t.id).join() !== `${prefix}-c`) throw new Error("pages");
});
await check("listAll", async () => {
	const ids = [];
	for await (const t of s2.accessTokens.listAll({ prefix })) ids.push(t.id);
	if (ids.length !== 3) throw new Error(ids.join());
});
await check("empty list", async () => {
	if ((await s2.accessTokens.list({ prefix: `ts-none-${rnd()}` })).accessTokens.length !== 0) throw new Error("not empty");
});
await check("issue variants", async () => {
	const expiresAt = new Date(Date.now() + 60_000);
	await s2.accessTokens.issue({ id: `ts-opg-ro-${rnd()}`, scope: { opGroups: { account: { read: true } } } });
	await s2.accessTokens.issue({ id: `ts-opg-rw-${rnd()}`, scope: { opGroups: { stream: { read: true, write: true } } } });
	await s2.accessTokens.issue({ id: `ts-exp-${rnd()}`, expiresAt, scope: { ops: ["list-basins"] } });
	await s2.accessTokens.issue({
		id: `ts-stream-exact-${rnd()}`,
		scope: { basins: { exact: basinA }, streams: { exact: streamA }, ops: ["read"] },
	});
	await s2.accessTokens.issue({
		id: `ts-autoprefix-${rnd()}`,
		autoPrefixStreams: true,
		scope: { basins: { prefix: "" }, streams: { prefix: "tenant/" }, ops: ["list-streams"] },
	});
});
await check("expiresAt round trip", async () => {
	const id = `ts-exp2-${rnd()}`;
	const expiresAt = new Date(Math.floor(Date.now() / 1000) * 1000 + 3_600_000);
	await s2.accessTokens.issue({ id, expiresAt, scope: { ops: ["list-basins"] } });
	const info = (await s2.accessTokens.list({ prefix: id })).accessTokens[0];
	if (!(info.expiresAt instanceof Date) || info.expiresAt.getTime() !== expiresAt.getTime()) throw new Error(String(info.expiresAt));
});
await rejects(
	"autoPrefix with exact scope",
	s2.accessTokens.issue({
		id: `ts-ap-bad-${rnd()}`,
		autoPrefixStreams: true,
		scope: { basins: { prefix: "" }, streams: { exact: "tenant/stream" }, ops: ["list-streams"] },
	}),
	422,
);
const dup = `ts-dup-${rnd()}`;
await s2.accessTokens.issue({ id: dup, scope: { ops: ["list-basins"] } });
await rejects("duplicate id", s2.accessTokens.issue({ id: dup, scope: { ops: ["list-basins"] } }), 409);
await s2.accessTokens.revoke({ id: dup });
await rejects("revoke twice", s2.accessTokens.revoke({ id: dup }), 404);
await rejects("revoke missing", s2.accessTokens.revoke({ id: `ts-missing-${rnd()}` }), 404);

// Authorization and scope.
await check("basin prefix allows create", async () => {
	const t = await s2.accessTokens.issue({
		id: `ts-basin-allow-${rnd()}`,
		scope: { basins: { prefix: "ts-" }, ops: ["create-basin", "create-stream"] },
	});
	await limited(t.accessToken).basins.create({ basin: `ts-scope-${rnd()}` });
});
{
	const t = await s2.accessTokens.issue({
		id: `ts-basin-deny-${rnd()}`,
		scope: { basins: { prefix: "allowed-" }, ops: ["create-basin"] },
	});
	await rejects("basin prefix denies", limited(t.accessToken).basins.create({ basin: `denied-${rnd()}` }), 403);
}
{
	const t = await s2.accessTokens.issue({ id: `ts-op-deny-${rnd()}`, scope: { ops: ["list-basins"] } });
	await rejects("missing op", limited(t.accessToken).basins.create({ basin: `shouldfail-${rnd()}` }), 403);
	await rejects("no list-access-tokens", limited(t.accessToken).accessTokens.list(), 403);
}
{
	const t = await s2.accessTokens.issue({
		id: `ts-limited-${rnd()}`,
		scope: { ops: ["list-basins", "issue-access-token"], accessTokens: { prefix: "" } },
	});
	await rejects(
		"escalation",
		limited(t.accessToken).accessTokens.issue({ id: `ts-escalate-${rnd()}`, scope: { ops: ["create-basin"] } }),
		403,
	);
}
{
	const t = await s2.accessTokens.issue({
		id: `ts-cross-${rnd()}`,
		scope: { basins: { exact: basinA }, streams: { prefix: "" }, ops: ["create-stream"] },
	});
	await rejects("cross basin", limited(t.accessToken).basin(basinB).streams.create({ stream: "test-stream" }), 403);
}
await check("auto-prefix enforced", async () => {
	const t = await s2.accessTokens.issue({
		id: `ts-ape-${rnd()}`,
		autoPrefixStreams: true,
		scope: { basins: { exact: basinA }, streams: { prefix: "tenant/" }, ops: ["create-stream", "list-streams"] },
	});
	const raw = `apx-${rnd()}`;
	const b = limited(t.accessToken).basin(basinA);
	await b.streams.create({ stream: raw });
	const mine = (await b.streams.list({ prefix: raw })).streams.map((s) => s.name);
	const all = (await s2.basin(basinA).streams.list({ prefix: "tenant/" })).streams.map((s) => s.name);
	if (!mine.includes(raw) || !all.includes(`tenant/${raw}`)) throw new Error(`${mine} ${all}`);
});

// Metrics: S2's range rules.
const now = Date.now();
const hour = { start: now - 3_600_000, end: now };
await check("account metric sets", async () => {
	for (const set of ["active-basins", "account-ops"]) await s2.metrics.account({ set, ...hour });
	for (const interval of ["minute", "hour", "day"]) await s2.metrics.account({ set: "account-ops", ...hour, interval });
	await s2.metrics.account({ set: "active-basins", start: 0, end: 3600 * 1000 });
});
await rejects("missing start", s2.metrics.account({ set: "active-basins", end: now }), 422);
await rejects("missing end", s2.metrics.account({ set: "active-basins", start: now - 3_600_000 }), 422);
await rejects("start after end", s2.metrics.account({ set: "active-basins", start: now, end: now - 3_600_000 }), 422);
await rejects("end in the future", s2.metrics.account({ set: "active-basins", start: now - 3_600_000, end: now + 600_000 }), 422);
await rejects("range too large", s2.metrics.account({ set: "active-basins", start: now - 40 * 86_400_000, end: now }), 422);
await check("basin metric sets", async () => {
	for (const set of ["storage", "append-ops", "read-ops", "read-throughput", "append-throughput", "basin-ops"])
		await s2.metrics.basin({ basin: basinA, set, ...hour });
	await s2.metrics.basin({ basin: basinA, set: "storage", start: now - 86_400_000, end: now, interval: "hour" });
	await s2.metrics.stream({ basin: basinA, stream: streamA, set: "storage", ...hour, interval: "minute" });
});
await rejects("basin storage per minute", s2.metrics.basin({ basin: basinA, set: "storage", ...hour, interval: "minute" }), 422);
await rejects("stream storage per hour", s2.metrics.stream({ basin: basinA, stream: streamA, set: "storage", ...hour, interval: "hour" }), 422);

// Locations.
await check("locations", async () => {
	const list = await s2.locations.list();
	const before = await s2.locations.getDefault();
	const updated = await s2.locations.setDefault({ location: before.name });
	if (list.length < 1 || typeof before.isPrivate !== "boolean" || updated.name !== before.name) throw new Error("locations");
});

// Encryption: a basin's stream_cipher, the key sent by the SDK, wrong key refused.
await check("encryption", async () => {
	const basin = `ts-enc-${rnd()}`;
	await s2.basins.create({ basin, config: { streamCipher: "aegis-256" } });
	const b = s2.basin(basin);
	await b.streams.create({ stream: "e" });
	const key = new Uint8Array(32).map((_, i) => i + 1);
	const st = b.stream("e", { encryptionKey: key });
	await st.append(AppendInput.create([AppendRecord.string({ body: "secret", headers: [["h", "v"]] })]));
	const batch = await st.read({ start: { from: { seqNum: 0 } }, stop: { limits: { count: 10 } } });
	if (batch.records.length !== 1 || batch.records[0].body !== "secret") throw new Error(JSON.stringify(batch.records));
	const info = (await b.streams.list({ prefix: "e" })).streams[0];
	if (info.cipher !== "aegis-256") throw new Error(`cipher ${info.cipher}`);
});
{
	const basin = `ts-enc2-${rnd()}`;
	await s2.basins.create({ basin, config: { streamCipher: "aes-256-gcm" } });
	await s2.basin(basin).streams.create({ stream: "e" });
	const st = s2.basin(basin).stream("e", { encryptionKey: new Uint8Array(32).fill(7) });
	await st.append(AppendInput.create([AppendRecord.string({ body: "x" })]));
	try {
		await s2.basin(basin).stream("e", { encryptionKey: new Uint8Array(32).fill(8) }).read({ start: { from: { seqNum: 0 } } });
		failures.push("wrong key: did not fail");
	} catch (e) {
		if (e.status !== 400 || e.code !== "decryption_failed") failures.push(`wrong key: ${e.status} ${e.code}`);
	}
}

console.log(JSON.stringify({ failures }));
process.exit(0);
