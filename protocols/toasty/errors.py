"""Toasty's refusals (CONTRACT §5): each is a code with one text, defined here once.

The server answers a refused request with its code's text, maybe followed by ``": "`` and a
detail (``ErrorCode.message``); the clients read the code back from a reply's text
(``ErrorCode.of``). The texts are the reference server's (research §B.4), so clients written
against it match on them.
"""

import enum
from typing import Optional


class ErrorCode(enum.Enum):
    NOT_FOUND = "No such file or directory"
    NOT_A_DIRECTORY = "Entity is not a directory"
    IS_A_DIRECTORY = "Entity is a directory"
    ALREADY_EXISTS = "File or directory already exists"
    BAD_GENERATION = "Generation counter mismatch or invalid value"
    INVALID_OPERATION = "Invalid operation"
    INVALID_PATH = "Invalid path"
    INVALID_RANGE = "Invalid range"
    CHUNK_NOT_FOUND = "Chunk not found"
    IO_ERROR = "I/O error"

    def message(self, detail=None) -> str:
        """The reply text: the code's text, and ``": detail"`` if there is one."""
        return self.value if not detail else "%s: %s" % (self.value, detail)

    @classmethod
    def of(cls, message: str) -> Optional["ErrorCode"]:
        """The code a reply's text starts with; None for a text that names none."""
        for code in cls:
            if message.startswith(code.value):
                return code
        return None


# A client starts a write over (from its READ) after these: someone else changed the file, or
# reclaimed a chunk, in between.
RETRYABLE = frozenset((ErrorCode.BAD_GENERATION, ErrorCode.ALREADY_EXISTS, ErrorCode.NOT_FOUND,
                       ErrorCode.CHUNK_NOT_FOUND))
