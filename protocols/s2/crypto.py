"""S2 record encryption (docs/protocols/s2.md, "Encryption"): a stream's ``stream_cipher``,
AEGIS-256 (``aeg``, a binding of libaegis) or AES-256-GCM (``cryptography``), keyed per request
by the ``s2-encryption-key`` header (base64 of 32 bytes) that the node never stores.

As S2 does: a regular record's headers and body are encrypted together; command records stay
plaintext (the node must read fences and trims); the stream id is the associated data, so a
record's ciphertext is accepted in no other stream. Stored form of an encrypted record: no
headers, body = ``nonce | ciphertext | 16-byte tag`` of msgpack ``[headers, body]``. Nonces are
random (32 bytes for AEGIS-256; 12 for AES-256-GCM, which is why S2 caps those streams at 2^32
records).
"""

import base64
import binascii
import os
import struct

import msgpack

from protocols.s2.codec import S2Error, bad

KEY_HEADER = "s2-encryption-key"
KEY_BYTES = 32
TAG_BYTES = 16
AES_GCM_MAX_RECORDS = 1 << 32


def _aegis256():
    try:
        from aeg import aegis256
    except ImportError:
        return None
    return aegis256


def available(cipher) -> bool:
    return cipher == "aes-256-gcm" or (cipher == "aegis-256" and _aegis256() is not None)


def parse_key(value) -> bytes:
    if value is None:
        raise bad("bad_header", "this stream is encrypted: the s2-encryption-key header is required")
    try:
        key = base64.b64decode(value.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise bad("bad_header", "s2-encryption-key must be base64")
    if len(key) != KEY_BYTES:
        raise bad("bad_header", "s2-encryption-key must be %d bytes (base64)" % KEY_BYTES)
    return key


def _decryption_failed():
    return S2Error(400, "decryption_failed", "records could not be decrypted with the given s2-encryption-key")


class RecordCipher:
    """Seals and opens the records of one stream with one key."""

    __slots__ = ("name", "ad", "nonce_bytes", "_enc", "_dec", "_key", "_aegis")

    def __init__(self, name, key: bytes, stream_id: int):
        self.name = name
        self.ad = struct.pack(">Q", stream_id)
        self._aegis = name == "aegis-256"
        if name == "aes-256-gcm":
            from cryptography.hazmat.primitives.ciphers.aead import AESGCM

            aead = AESGCM(key)
            self.nonce_bytes = 12
            self._enc, self._dec = aead.encrypt, aead.decrypt
        elif self._aegis:
            aegis = _aegis256()
            if aegis is None:
                raise S2Error(501, "not_implemented", "aegis-256 needs the aeg package, which is not installed")
            self.nonce_bytes = aegis.NONCEBYTES
            self._key = key
            self._enc, self._dec = aegis.encrypt, aegis.decrypt
        else:
            raise S2Error(422, "invalid", "unknown stream cipher %r" % name)

    def seal(self, headers, body) -> bytes:
        nonce = os.urandom(self.nonce_bytes)
        plain = msgpack.packb([headers, body], use_bin_type=True)
        if self._aegis:
            return nonce + self._enc(self._key, nonce, plain, self.ad, maclen=TAG_BYTES)
        return nonce + self._enc(nonce, plain, self.ad)

    def open(self, blob):
        n = self.nonce_bytes
        if len(blob) < n + TAG_BYTES:
            raise _decryption_failed()
        view = memoryview(blob)
        try:
            if self._aegis:
                plain = self._dec(self._key, view[:n], view[n:], self.ad, maclen=TAG_BYTES)
            else:
                plain = self._dec(bytes(view[:n]), bytes(view[n:]), self.ad)
        except Exception:  # InvalidTag (cryptography) / ValueError (aeg): wrong key or tampering
            raise _decryption_failed()
        headers, body = msgpack.unpackb(plain, use_list=False)
        return headers, body


def is_command(headers) -> bool:
    return bool(headers) and len(headers) == 1 and headers[0][0] == b""
