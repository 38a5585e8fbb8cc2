"""Multi-buffer SHA-256 (numba): the digests of many buffers of one length, computed in lock-step,
one buffer per vector lane. Imported lazily through ``storage.jit.import_compiled`` by
``storage.sha256`` (numba is slow to import and compiles on first use); ``storage.sha256`` keeps
hashlib for everything this does not take.

A single SHA-256 is a serial chain of 64 rounds per 64-byte block, which no vector unit can
shorten; on a CPU without SHA extensions OpenSSL runs it at ~390 MB per CPU-second here. But
chunks are hashed independently (CONTRACT §2/§5: a chunk's address is the SHA-256 of its bytes),
so the rounds of up to ``LANES`` chunks can run side by side as 32-bit vector lanes, the way
Intel's multi-buffer hashing (isa-l_crypto ``mb_sha256``, intel-ipsec-mb) does. The state is kept
as structure-of-arrays with the lane innermost, so every lane loop below compiles to a few vector
instructions (vprold for the rotations where AVX-512VL is there).
"""

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

JIT = dict(cache=True, nogil=True)

LANES = 32  # buffers hashed together at most (the workspace below then fits a 32 KiB L1 cache)
VEC = 8  # lanes per vector: the lane loops run over whole vectors of 8 (ymm; LLVM's preferred width)

# One uint32 workspace, the lane innermost: W (the message schedule, 64 rows), then A and E (each
# round's new a and e, 4 + 64 rows: b, c, d are earlier a's, f, g, h earlier e's), then H (the
# chaining value, 8 rows). One array with constant row offsets lets LLVM see that the rows a round
# reads never overlap the row it writes, so the lane loops vectorize without run-time alias checks.
W0 = 0
A0 = 64 * LANES
E0 = A0 + 68 * LANES
H0 = E0 + 68 * LANES
WORK = H0 + 8 * LANES

K = np.array([
    0x428A2F98, 0x71374491, 0xB5C0FBCF, 0xE9B5DBA5, 0x3956C25B, 0x59F111F1, 0x923F82A4, 0xAB1C5ED5,
    0xD807AA98, 0x12835B01, 0x243185BE, 0x550C7DC3, 0x72BE5D74, 0x80DEB1FE, 0x9BDC06A7, 0xC19BF174,
    0xE49B69C1, 0xEFBE4786, 0x0FC19DC6, 0x240CA1CC, 0x2DE92C6F, 0x4A7484AA, 0x5CB0A9DC, 0x76F988DA,
    0x983E5152, 0xA831C66D, 0xB00327C8, 0xBF597FC7, 0xC6E00BF3, 0xD5A79147, 0x06CA6351, 0x14292967,
    0x27B70A85, 0x2E1B2138, 0x4D2C6DFC, 0x53380D13, 0x650A7354, 0x766A0ABB, 0x81C2C92E, 0x92722C85,
    0xA2BFE8A1, 0xA81A664B, 0xC24B8B70, 0xC76C51A3, 0xD192E819, 0xD6990624, 0xF40E3585, 0x106AA070,
    0x19A4C116, 0x1E376C08, 0x2748774C, 0x34B0BCB5, 0x391C0CB3, 0x4ED8AA4A, 0x5B9CCA4F, 0x682E6FF3,
    0x748F82EE, 0x78A5636F, 0x84C87814, 0x8CC70208, 0x90BEFFFA, 0xA4506CEB, 0xBEF9A3F7, 0xC67178F2,
], dtype=np.uint32)
IV = np.array([0x6A09E667, 0xBB67AE85, 0x3C6EF372, 0xA54FF53A, 0x510E527F, 0x9B05688C, 0x1F83D9AB, 0x5BE0CD19],
              dtype=np.uint32)


@intrinsic
def load_be32(typingctx, addr):
    """The big-endian uint32 at address ``addr`` (any alignment)."""
    sig = types.uint32(types.uint64)

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        value = builder.load(builder.inttoptr(args[0], i32.as_pointer()), align=1)
        return builder.call(builder.module.declare_intrinsic("llvm.bswap", [i32]), [value])

    return sig, codegen


@intrinsic
def load_byte(typingctx, addr):
    """The byte at address ``addr``."""
    sig = types.uint8(types.uint64)

    def codegen(context, builder, signature, args):
        return builder.load(builder.inttoptr(args[0], ir.IntType(8).as_pointer()), align=1)

    return sig, codegen


@intrinsic
def rotr(typingctx, x, n):
    """32-bit rotate right (LLVM turns the shifts into a rotate: vprold on vectors)."""
    sig = types.uint32(types.uint32, types.uint32)

    def codegen(context, builder, signature, args):
        x, n = args
        return builder.or_(builder.lshr(x, n), builder.shl(x, builder.sub(ir.Constant(n.type, 32), n)))

    return sig, codegen


@njit(inline="always", **JIT)
def _compress(S, nl):
    """One 64-byte block of lanes [0, nl) (a multiple of VEC): W rows 0-15 hold the block's words;
    H is updated."""
    k = K
    for t in range(16, 64):
        for lane in range(nl):
            x = S[W0 + (t - 15) * LANES + lane]
            y = S[W0 + (t - 2) * LANES + lane]
            s0 = rotr(x, np.uint32(7)) ^ rotr(x, np.uint32(18)) ^ (x >> np.uint32(3))
            s1 = rotr(y, np.uint32(17)) ^ rotr(y, np.uint32(19)) ^ (y >> np.uint32(10))
            S[W0 + t * LANES + lane] = np.uint32(S[W0 + (t - 16) * LANES + lane] + s0 + S[W0 + (t - 7) * LANES + lane] + s1)
    for i in range(4):
        for lane in range(nl):
            S[A0 + i * LANES + lane] = S[H0 + (3 - i) * LANES + lane]
            S[E0 + i * LANES + lane] = S[H0 + (7 - i) * LANES + lane]
    for t in range(64):
        kt = k[t]
        for lane in range(nl):
            a = S[A0 + (t + 3) * LANES + lane]
            b = S[A0 + (t + 2) * LANES + lane]
            c = S[A0 + (t + 1) * LANES + lane]
            d = S[A0 + t * LANES + lane]
            e = S[E0 + (t + 3) * LANES + lane]
            f = S[E0 + (t + 2) * LANES + lane]
            g = S[E0 + (t + 1) * LANES + lane]
            h = S[E0 + t * LANES + lane]
            s1 = rotr(e, np.uint32(6)) ^ rotr(e, np.uint32(11)) ^ rotr(e, np.uint32(25))
            ch = (e & f) ^ (~e & g)
            t1 = np.uint32(h + s1 + ch + kt + S[W0 + t * LANES + lane])
            s0 = rotr(a, np.uint32(2)) ^ rotr(a, np.uint32(13)) ^ rotr(a, np.uint32(22))
            mj = (a & b) ^ (a & c) ^ (b & c)
            S[A0 + (t + 4) * LANES + lane] = np.uint32(t1 + s0 + mj)
            S[E0 + (t + 4) * LANES + lane] = np.uint32(d + t1)
    for i in range(4):
        for lane in range(nl):
            S[H0 + i * LANES + lane] += S[A0 + (67 - i) * LANES + lane]
            S[H0 + (4 + i) * LANES + lane] += S[E0 + (67 - i) * LANES + lane]


@njit(**JIT)
def _compress_lanes(S, nl):
    # _compress inlined with a constant lane count: loops of a known length vectorize with no
    # run-time checks (the row offsets are constants too)
    if nl == 2 * VEC:
        _compress(S, 2 * VEC)
    elif nl == 3 * VEC:
        _compress(S, 3 * VEC)
    else:
        _compress(S, LANES)


@njit(**JIT)
def sha256_lanes(addrs, length, out):
    """SHA-256 of ``len(addrs)`` buffers of ``length`` bytes each, the i-th at address
    ``addrs[i]`` (uint64), into ``out[i]`` (uint8[n, 32]). The caller keeps the buffers alive and
    unchanged for the call; nothing outside [addrs[i], addrs[i] + length) is read."""
    n = addrs.shape[0]
    S = np.empty(WORK, np.uint32)
    pad = np.zeros((LANES, 128), np.uint8)
    ptr = np.empty(LANES, np.uint64)
    blocks = length // 64
    rest = length % 64
    pad_blocks = 1 if rest < 56 else 2
    bits = np.uint64(length) * np.uint64(8)
    for g in range(0, n, LANES):
        m = min(LANES, n - g)
        # lanes computed: whole vectors, at least two (LLVM's vector loop wants two vectors per
        # iteration: 8 lanes alone ran the scalar loop, ~5x slower); the spare ones rehash lane 0
        nl = max(2 * VEC, (m + VEC - 1) // VEC * VEC)
        for lane in range(nl):
            ptr[lane] = addrs[g + lane] if lane < m else addrs[g]
        for i in range(8):
            for lane in range(nl):
                S[H0 + i * LANES + lane] = IV[i]
        for b in range(blocks):
            off = np.uint64(b * 64)
            for lane in range(nl):
                p = ptr[lane] + off
                for t in range(16):
                    S[W0 + t * LANES + lane] = load_be32(p + np.uint64(4 * t))
            _compress_lanes(S, nl)
        # FIPS 180-4 §5.1.1 padding: the tail, 0x80, zeros, the length in bits (big-endian)
        for lane in range(nl):
            p = ptr[lane] + np.uint64(blocks * 64)
            for i in range(128):
                pad[lane, i] = 0
            for i in range(rest):
                pad[lane, i] = load_byte(p + np.uint64(i))
            pad[lane, rest] = 0x80
            for i in range(8):
                pad[lane, pad_blocks * 64 - 1 - i] = np.uint8((bits >> np.uint64(8 * i)) & np.uint64(0xFF))
        for pb in range(pad_blocks):
            for lane in range(nl):
                for t in range(16):
                    o = pb * 64 + 4 * t
                    S[W0 + t * LANES + lane] = ((np.uint32(pad[lane, o]) << np.uint32(24)) | (np.uint32(pad[lane, o + 1]) << np.uint32(16))
                                                | (np.uint32(pad[lane, o + 2]) << np.uint32(8)) | np.uint32(pad[lane, o + 3]))
            _compress_lanes(S, nl)
        for lane in range(m):
            for i in range(8):
                x = S[H0 + i * LANES + lane]
                out[g + lane, 4 * i] = np.uint8(x >> np.uint32(24))
                out[g + lane, 4 * i + 1] = np.uint8((x >> np.uint32(16)) & np.uint32(0xFF))
                out[g + lane, 4 * i + 2] = np.uint8((x >> np.uint32(8)) & np.uint32(0xFF))
                out[g + lane, 4 * i + 3] = np.uint8(x & np.uint32(0xFF))
