"""A pickle stack machine that never imports, looks up or calls anything.

This is the one pickle decoder shared by the checkpoint converter and the scanner. It
decodes opcodes over an in-memory ``bytes`` object, checks every length against the bytes
really present before slicing, and builds plain values (None, bool, int, float, str, bytes,
tuple, list, dict, set). Everything that would make ``pickle`` import or call code (GLOBAL,
STACK_GLOBAL, INST, OBJ, REDUCE, NEWOBJ, BUILD, persistent ids, extensions, out-of-band
buffers) is handed to a :class:`Policy`:

* the converter's policy maps a fixed table of names to inert stand-ins and refuses the rest;
* the scanner's policy turns every global into a record and every call into a symbolic node, so
  computed ``STACK_GLOBAL`` operands are simply the stack values they are.

``pickle.Unpickler`` is never used, not even with ``find_class`` overridden: REDUCE and BUILD
would still call whatever ``find_class`` returns.
"""

from __future__ import annotations

import codecs
import math
import re
import struct
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

from ._errors import CheckpointError, SafetensorError

__all__ = [
    "MARK_OPS",
    "Budget",
    "Limits",
    "Machine",
    "Policy",
    "decode_pickle",
]

#: Opcodes a protocol-0..5 pickle may contain, by byte value, with their names (for messages).
OPNAMES: Final[dict[int, str]] = {
    ord(c): n
    for c, n in [
        ("(", "MARK"), (".", "STOP"), ("0", "POP"), ("1", "POP_MARK"), ("2", "DUP"),
        ("F", "FLOAT"), ("I", "INT"), ("J", "BININT"), ("K", "BININT1"), ("L", "LONG"),
        ("M", "BININT2"), ("N", "NONE"), ("P", "PERSID"), ("Q", "BINPERSID"), ("R", "REDUCE"),
        ("S", "STRING"), ("T", "BINSTRING"), ("U", "SHORT_BINSTRING"), ("V", "UNICODE"),
        ("X", "BINUNICODE"), ("a", "APPEND"), ("b", "BUILD"), ("c", "GLOBAL"), ("d", "DICT"),
        ("}", "EMPTY_DICT"), ("e", "APPENDS"), ("g", "GET"), ("h", "BINGET"), ("i", "INST"),
        ("j", "LONG_BINGET"), ("l", "LIST"), ("]", "EMPTY_LIST"), ("o", "OBJ"), ("p", "PUT"),
        ("q", "BINPUT"), ("r", "LONG_BINPUT"), ("s", "SETITEM"), ("t", "TUPLE"),
        (")", "EMPTY_TUPLE"), ("u", "SETITEMS"), ("G", "BINFLOAT"), ("B", "BINBYTES"),
        ("C", "SHORT_BINBYTES"),
    ]
} | {
    0x80: "PROTO", 0x81: "NEWOBJ", 0x82: "EXT1", 0x83: "EXT2", 0x84: "EXT4", 0x85: "TUPLE1",
    0x86: "TUPLE2", 0x87: "TUPLE3", 0x88: "NEWTRUE", 0x89: "NEWFALSE", 0x8A: "LONG1",
    0x8B: "LONG4", 0x8C: "SHORT_BINUNICODE", 0x8D: "BINUNICODE8", 0x8E: "BINBYTES8",
    0x8F: "EMPTY_SET", 0x90: "ADDITEMS", 0x91: "FROZENSET", 0x92: "NEWOBJ_EX",
    0x93: "STACK_GLOBAL", 0x94: "MEMOIZE", 0x95: "FRAME", 0x96: "BYTEARRAY8",
    0x97: "NEXT_BUFFER", 0x98: "READONLY_BUFFER",
}  # fmt: skip

#: Opcodes that pop to the last MARK.
MARK_OPS: Final = frozenset(b"tldeusio\x90\x91")

_I4: Final = struct.Struct("<i")
_U4: Final = struct.Struct("<I")
_U8: Final = struct.Struct("<Q")
_U2: Final = struct.Struct("<H")
_F8: Final = struct.Struct(">d")


@dataclass(frozen=True, slots=True)
class Limits:
    """Resource caps for one pickle stream (every count in a pickle is attacker-chosen)."""

    max_ops: int = 50_000_000
    """Opcodes executed."""
    max_stack: int = 1_000_000
    """Items on the stack plus items under open marks."""
    max_marks: int = 100_000
    """Nesting depth of MARK."""
    max_memo: int = 10_000_000
    """Memo entries."""
    max_long_bytes: int = 4096
    """Bytes of one LONG1/LONG4 (int() of huge numbers is quadratic)."""
    max_line: int = 1 << 62
    """Bytes of one text-protocol argument line. Uncapped by default: CPython has no such cap,
    a line is a slice of bytes already in memory, and a cap made a safetensors file whose header
    length starts with PUT or PERSID (0x70, 0x50) and whose header is larger look like a
    pickle stopped early."""
    max_key_depth: int = 100
    """Nesting of tuples in a dict key or set item (hashing one recurses without a guard)."""
    max_key_items: int = 1_000_000
    """Items hashing one dict key or set item visits, shared tuples counted each time."""
    max_containers: int = 8_000_000
    """Tuples, lists, dicts and sets built, and results of the policy's calls. Items put into a
    container leave the stack, so the stack cap bounds nothing there, and a one-byte EMPTY_SET
    is a 216-byte set: 20 million of them in a list took 4.4 GiB (8 million: 1.7 GiB). A real
    checkpoint builds six a tensor, so 1.3 million tensors fit in one pickle."""
    max_items: int = 50_000_000
    """Items put into containers, in all (by the opcodes and by the policy's calls)."""
    max_copied_bytes: int = 256 << 20
    """Bytes the policy's calls copy in all (``bytearray(b)``, ``_codecs.encode(s)``...). The
    stream's own operands are bounded by its length, but a call on a value from the memo costs
    five bytes of the stream however large the value: a 4 MiB ``bytes`` copied 400 times was
    1.6 GiB from a 4 MiB pickle."""
    max_hash_items: int = 50_000_000
    """Items visited hashing dict keys and set items, in all. A tuple does not keep its hash:
    a key of a million items, set a million times over, is 10**12 items to hash."""


class Policy(Protocol):
    """What the machine does with the opcodes that would reach outside the pickle."""

    def global_(self, module: str, name: str, offset: int, opcode: str) -> Any:
        """GLOBAL, STACK_GLOBAL (module/name already checked to be ``str``), INST/OBJ class."""

    def bad_stack_global(self, module: Any, name: Any, offset: int) -> Any:
        """STACK_GLOBAL whose operands are not both ``str``."""

    def reduce(self, func: Any, args: Any, offset: int, opcode: str) -> Any:
        """REDUCE, NEWOBJ, NEWOBJ_EX, INST, OBJ: ``func(*args)``. ``args`` is a tuple, except
        for a policy whose ``computed_arguments`` attribute is true: REDUCE and NEWOBJ then
        hand over what the stack holds (a call's result, which the machine cannot know to be
        a tuple) instead of stopping there (a scanner stopped reading, and missed what came
        after)."""

    def build(self, obj: Any, state: Any, offset: int) -> Any:
        """BUILD: apply ``state`` to ``obj``; returns what replaces ``obj`` on the stack."""

    def persistent(self, pid: Any, offset: int, opcode: str) -> Any:
        """PERSID / BINPERSID."""

    def extension(self, code: int, offset: int) -> Any:
        """EXT1/EXT2/EXT4: an entry of the copyreg extension registry."""

    def buffer(self, offset: int, opcode: str) -> Any:
        """NEXT_BUFFER / READONLY_BUFFER (out-of-band data)."""

    def mutate(self, target: Any, opcode: str, items: list[Any], offset: int) -> None:
        """APPEND(S)/SETITEM(S)/ADDITEMS on something that is not a list/dict/set."""

    def unhashable(self, key: Any, offset: int) -> Any:
        """A dict key or set item that cannot be hashed; return a replacement or raise."""

    def text(self, raw: bytes, offset: int) -> Any:
        """Decode a py2 STRING/BINSTRING/SHORT_BINSTRING payload."""

    def notice(self, message: str, offset: int) -> None:
        """Report an oddity that is not fatal (duplicate PROTO, frame violations...)."""

    def proto(self, protocol: int, offset: int) -> None:
        """A PROTO opcode: the stream's protocol is ``protocol`` from here on (names of
        Python 2 modules are read differently below protocol 3)."""


@dataclass(slots=True)
class Result:
    """The outcome of running one pickle stream."""

    value: Any
    """The object STOP returned."""
    end: int
    """Offset just after STOP."""
    protocol: int
    """The PROTO number (0 if absent)."""
    ops: int = 0
    """Opcodes executed."""
    opcodes_seen: set[str] = field(default_factory=set)
    """Names of the opcodes executed."""


# The text numbers of protocols 0 and 1, read exactly as CPython's unpickler reads them: a
# reading of our own (``int("010")`` is 10, CPython's 8) would turn the same file into other
# tensors than torch.load builds (a storage offset written as ``I010``).
_C_SPACE: Final = b" \t\n\v\f\r"
#: What C's ``strtol(s, &end, 0)`` reads: blanks, a sign, hex, octal or decimal digits.
_STRTOL: Final = re.compile(rb"[ \t\n\v\f\r]*([+-]?)(0[xX][0-9a-fA-F]+|0[0-7]*|[1-9][0-9]*)")
#: What ``PyOS_string_to_double`` reads: no blanks, no underscores, inf/infinity/nan.
_C_DOUBLE: Final = re.compile(
    rb"[+-]?(?:(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?|inf(?:inity)?|nan)",
    re.IGNORECASE,
)


def _c_string(raw: bytes) -> bytes:
    """``raw`` as C code sees it: up to its first NUL."""
    return raw.split(b"\0", 1)[0]


def _python_int(raw: bytes, offset: int, opcode: str, base: int = 0) -> int:
    """``PyLong_FromString(raw, NULL, base)`` of the line up to its first NUL: Python's int
    syntax, which ``int(bytes, base)`` implements (base 0: ``0x10``, ``1_0``; ``010`` is an
    error; base 10, GET/PUT: ``+1``, `` 1 `` and ``1_0`` are numbers, ``0x1`` is not)."""
    try:
        return int(_c_string(raw), base)
    except ValueError:
        raise _err(f"invalid operand ({opcode} {raw[:40]!r} is not a number)", offset) from None


def _text_int(raw: bytes, offset: int) -> int | bool:
    """An INT operand as CPython's ``load_int`` reads it: ``strtol`` in base 0 (``010`` is 8,
    ``0x10`` 16), a bool for a two-character 0 or 1 (``00``, ``01``), and Python's int syntax
    when ``strtol`` overflows or stops before the line ends."""
    if not raw:
        raise _err("invalid operand (INT is empty)", offset)
    if raw[:1] == b"\0":
        # strtol reads no digits and stops at the NUL, which ends the C string: CPython takes
        # 0 (a scanner that refused it stopped parsing where pickle.load goes on to run code).
        return False if len(raw) == 2 else 0
    match = _STRTOL.match(raw)
    if match is not None and raw[match.end() : match.end() + 1] in (b"", b"\0"):
        sign, digits = match.groups()
        if digits[:2] in (b"0x", b"0X"):
            value = int(digits[2:], 16)
        else:
            value = int(digits, 8 if digits.startswith(b"0") else 10)
        value = -value if sign == b"-" else value
        if -(1 << 63) <= value < 1 << 63:  # a C long
            return bool(value) if len(raw) == 2 and value in (0, 1) else value
    return _python_int(raw, offset, "INT")


def _text_long(raw: bytes, offset: int) -> int:
    """A LONG operand as CPython's ``load_long`` reads it: one trailing ``L`` dropped, then
    Python's int syntax in base 0."""
    if not raw:
        raise _err("invalid operand (LONG is empty)", offset)
    return _python_int(raw[:-1] if raw.endswith(b"L") else raw, offset, "LONG")


def _text_float(raw: bytes, offset: int) -> float:
    """A FLOAT operand as CPython's ``load_float`` reads it (``PyOS_string_to_double``, which
    refuses what overflows a double)."""
    text = _c_string(raw)
    match = _C_DOUBLE.match(text)
    if match is None or match.end() != len(text):
        raise _err(f"invalid operand (FLOAT {raw[:40]!r} is not a number)", offset)
    value = float(text)
    if math.isinf(value) and not text.lstrip(b"+-")[:1].isalpha():
        raise _err(f"invalid operand (FLOAT {raw[:40]!r} overflows a double)", offset)
    return value


def _err(message: str, offset: int, kind: str = "PickleError") -> CheckpointError:
    return CheckpointError(f"pickle: {message} at byte {offset}", kind=kind, offset=offset)


#: The kind of errors where the stream runs out before the pickle ends (the bytes given may
#: just be too few: a reader holding a prefix of the file can read more and try again).
TRUNCATED: Final = "PickleTruncated"

#: The kind of errors where a :class:`Limits` cap stops the machine: CPython's unpickler has no
#: such caps and would read on (a scanner must not take such a stop for the pickle's end).
LIMIT: Final = "PickleLimit"

#: Distinct dict keys or set items of one hash value allowed in one stream. Colliding keys make
#: every insertion compare against all the others before it (a dict of 160,000 integer keys
#: ``k * (2**61 - 1)``, all hashing to 0, took minutes to build); real checkpoints have none.
MAX_COLLISIONS: Final = 1000

#: Ints hash to themselves below this magnitude (hashes are taken modulo ``2**61 - 1``), so
#: only larger ones can collide with other ints.
_HASH_MODULUS: Final = (1 << 61) - 1


class Budget:
    """What one :class:`Machine` has built, against its :class:`Limits`.

    The machine charges what its opcodes build. A policy's calls build from values the stream
    hands them (a ``torch.Size`` copies a list, ``bytearray`` copies bytes, ``OrderedDict``
    hashes keys): they charge what they build here before building it, and hash stream values
    only through :meth:`hashable`, so the limits hold whatever the calls do. Offsets are
    absolute (the ``base`` of the machine already added).
    """

    __slots__ = (
        "limits",
        "policy",
        "containers",
        "items",
        "copied",
        "hashed",
        "_measured",
        "_hashes",
    )

    def __init__(self, limits: Limits, policy: Policy) -> None:
        self.limits = limits
        self.policy = policy
        self.containers = 0
        self.items = 0
        self.copied = 0
        self.hashed = 0
        # Tuples already measured, by id: (the tuple, its height, items hashing it visits).
        # The tuple is kept with its measure, so its id stays its own while the entry lives.
        self._measured: dict[int, tuple[tuple[Any, ...], int, int]] = {}
        # Hash value -> [the first key of that hash seen, how many keys unlike it followed]:
        # for the keys whose hashes an attacker can make collide (see MAX_COLLISIONS).
        self._hashes: dict[int, list[Any]] = {}

    def grow(self, containers: int, items: int, offset: int) -> None:
        """Charge ``containers`` new containers (or call results) holding ``items`` items."""
        self.containers += containers
        self.items += items
        if self.containers > self.limits.max_containers:
            raise _err(f"pickle builds over {self.limits.max_containers} containers", offset, LIMIT)
        if self.items > self.limits.max_items:
            raise _err(
                f"pickle puts over {self.limits.max_items} items in containers", offset, LIMIT
            )

    def copy(self, nbytes: int, offset: int) -> None:
        """Charge ``nbytes`` bytes that a call copies (before it copies them)."""
        self.copied += nbytes
        if self.copied > self.limits.max_copied_bytes:
            raise _err(
                f"calls of allowed globals copy over {self.limits.max_copied_bytes} bytes in all",
                offset,
                LIMIT,
            )

    def hashable(self, key: Any, offset: int) -> Any:
        """``key``, once hashing it is known to be safe and within the budget, or the
        policy's replacement for an unhashable key."""
        items = self._measure(key, offset) if type(key) is tuple else 1
        self.hashed += items
        if self.hashed > self.limits.max_hash_items:
            raise _err(
                f"hashing dict keys and set items visits over {self.limits.max_hash_items} "
                "items in all",
                offset,
                LIMIT,
            )
        try:
            value = hash(key)
        except TypeError:
            return self.policy.unhashable(key, offset)
        kind = type(key)
        if kind is str or kind is bytes or (kind is int and -_HASH_MODULUS < key < _HASH_MODULUS):
            # Text hashes are salted per process; small ints only collide with large ones,
            # which are counted.
            return key
        first = self._hashes.get(value)
        if first is None:
            self._hashes[value] = [key, 0]
        elif not (type(first[0]) is kind and first[0] == key):
            first[1] += 1
            if first[1] > MAX_COLLISIONS:
                raise _err(
                    f"over {MAX_COLLISIONS} distinct dict keys or set items share one hash "
                    "value (a hash-collision flood)",
                    offset,
                    LIMIT,
                )
        return key

    def _measure(self, key: tuple[Any, ...], offset: int) -> int:
        """How many items hashing ``key`` visits; refuses one nested too deep or too large.

        Tuples hash their items recursively in C, with no depth guard (a key nested a million
        tuples deep crashed the process) and no memory of shared items (``t = (t, t)`` a hundred
        times over is 2**100 items to hash). Every tuple used as a key is measured first,
        iteratively, each distinct tuple once: its height and how many items hashing it visits.
        """
        lim = self.limits
        measured = self._measured
        todo: list[tuple[tuple[Any, ...], int, bool]] = [(key, 1, False)]
        while todo:
            t, depth, children_done = todo.pop()
            if id(t) in measured:
                continue
            if not children_done:
                todo.append((t, depth, True))
                for x in t:
                    if type(x) is not tuple:
                        continue
                    known = measured.get(id(x))
                    below = depth + (known[1] if known is not None else 1)
                    if below > lim.max_key_depth:
                        raise _err(
                            f"a dict key or set item nests tuples over {lim.max_key_depth} deep",
                            offset,
                            LIMIT,
                        )
                    if known is None:
                        todo.append((x, depth + 1, False))
                continue
            height, items = 1, len(t)
            for x in t:
                if type(x) is tuple:
                    _, h, n = measured[id(x)]
                    height = max(height, h + 1)
                    items += n
            if items > lim.max_key_items:
                raise _err(
                    f"a dict key or set item holds over {lim.max_key_items} items in its "
                    "nested tuples (counting shared ones each time they occur)",
                    offset,
                    LIMIT,
                )
            measured[id(t)] = (t, height, items)
        return measured[id(key)][2]


class Machine:
    """Run pickle streams from ``data`` under ``policy``.

    Args:
        data: The whole buffer (a file, a zip member); streams are located by offset.
        policy: What to do with the opcodes that would reach outside the pickle.
        limits: Resource caps.
        base: Added to offsets in messages (where ``data`` sits in a larger file).
    """

    def __init__(
        self, data: bytes, policy: Policy, limits: Limits | None = None, *, base: int = 0
    ) -> None:
        self.data = data
        self.policy = policy
        self.limits = limits or Limits()
        self.base = base
        self.budget = Budget(self.limits, policy)
        """What the streams this machine runs have built; the policy's calls charge it too."""

    def run(self, start: int = 0) -> Result:
        """Run the stream that begins at ``start`` up to its STOP.

        Raises:
            CheckpointError: The stream is malformed, truncated or over a limit.
            SafetensorError: Whatever the policy raises (e.g. ``UnsafePickleError``).
        """
        try:
            return self._run(start)
        except SafetensorError:
            raise
        except RecursionError as exc:
            at = self.base + _opcode_offset(exc, start)
            raise _err("structure nested too deeply", at, LIMIT) from None
        except (ValueError, TypeError, OverflowError, UnicodeError, struct.error) as exc:
            # Number parsing and text decoding of hostile operands; one error class out.
            at = self.base + _opcode_offset(exc, start)
            raise _err(f"invalid operand ({exc})", at) from None

    def _run(self, start: int) -> Result:  # noqa: C901 - one flat opcode switch reads best
        data = self.data
        end = len(data)
        lim = self.limits
        policy = self.policy
        base = self.base
        stack: list[Any] = []
        marks: list[list[Any]] = []
        memo: dict[int, Any] = {}
        pos = start
        ops = 0
        protocol = 0
        frame_end = -1
        seen: set[str] = set()

        def take(n: int, at: int) -> int:
            # Bounds check before any slicing: lengths come from the attacker.
            nonlocal pos
            if n < 0 or pos + n > end:
                raise _err(f"truncated: needs {n} bytes, {end - pos} left", base + at, TRUNCATED)
            if frame_end >= 0 and pos < frame_end < pos + n:
                policy.notice("an operand crosses the end of its FRAME", base + at)
            p = pos
            pos += n
            return p

        def line(at: int) -> bytes:
            nonlocal pos
            nl = data.find(b"\n", pos, min(end, pos + lim.max_line))
            if nl < 0:
                if end - pos > lim.max_line:
                    raise _err(f"a text operand over {lim.max_line} bytes", base + at, LIMIT)
                raise _err("unterminated text operand", base + at, TRUNCATED)
            if frame_end >= 0 and pos < frame_end <= nl:
                # CPython reads a line past its frame from the bytes after the frame.
                policy.notice("an operand crosses the end of its FRAME", base + at)
            out = data[pos:nl]
            pos = nl + 1
            return out

        def pop_mark(at: int) -> list[Any]:
            nonlocal stack
            if not marks:
                raise _err("no MARK on the stack", base + at)
            items = stack
            stack = marks.pop()
            grow(1, len(items), at)  # a container of them, or items put into one
            return items

        budget = self.budget

        def grow(containers: int, items: int, at: int) -> None:
            budget.grow(containers, items, base + at)

        def pop(at: int) -> Any:
            if not stack:
                raise _err("stack underflow", base + at)
            return stack.pop()

        def hashable(key: Any, at: int) -> Any:
            return budget.hashable(key, base + at)

        while True:
            if pos >= end:
                raise _err("stream ends without STOP", base + pos, TRUNCATED)
            at = pos
            op = data[pos]
            pos += 1
            ops += 1
            if ops > lim.max_ops:
                raise _err(f"more than {lim.max_ops} opcodes", base + at, LIMIT)
            name = OPNAMES.get(op)
            if name is None:
                raise _err(f"unknown opcode 0x{op:02x}", base + at)
            seen.add(name)
            if frame_end >= 0 and at >= frame_end:
                frame_end = -1
            if op == 0x71:  # BINPUT
                idx = data[take(1, at)]
                memo[idx] = _top(stack, base + at)
            elif op == 0x68:  # BINGET
                stack.append(_memo_get(memo, data[take(1, at)], base + at))
            elif op == 0x58:  # BINUNICODE
                n = _U4.unpack_from(data, take(4, at))[0]
                p = take(n, at)
                stack.append(data[p : p + n].decode("utf-8", "surrogatepass"))
            elif op == 0x4B:  # BININT1
                stack.append(data[take(1, at)])
            elif op == 0x28:  # MARK
                if len(marks) >= lim.max_marks:
                    raise _err("MARK nesting over the limit", base + at, LIMIT)
                marks.append(stack)
                stack = []
            elif op == 0x74:  # TUPLE
                # pop_mark rebinds ``stack``: take the items before touching it.
                items = pop_mark(at)
                stack.append(tuple(items))
            elif op == 0x85:  # TUPLE1
                grow(1, 1, at)
                stack.append((pop(at),))
            elif op == 0x86:  # TUPLE2
                grow(1, 2, at)
                b = pop(at)
                stack.append((pop(at), b))
            elif op == 0x87:  # TUPLE3
                grow(1, 3, at)
                c = pop(at)
                b = pop(at)
                stack.append((pop(at), b, c))
            elif op == 0x29:  # EMPTY_TUPLE
                stack.append(())
            elif op == 0x52:  # REDUCE
                args = pop(at)
                func = pop(at)
                if type(args) is not tuple and not getattr(policy, "computed_arguments", False):
                    raise _err("REDUCE arguments are not a tuple", base + at)
                stack.append(policy.reduce(func, args, base + at, "REDUCE"))
            elif op == 0x51:  # BINPERSID
                stack.append(policy.persistent(pop(at), base + at, "BINPERSID"))
            elif op == 0x63:  # GLOBAL
                module = line(at).decode("utf-8")
                gname = line(at).decode("utf-8")
                stack.append(policy.global_(module, gname, base + at, "GLOBAL"))
            elif op == 0x93:  # STACK_GLOBAL
                gname = pop(at)
                module = pop(at)
                if type(module) is str and type(gname) is str:
                    stack.append(policy.global_(module, gname, base + at, "STACK_GLOBAL"))
                else:
                    stack.append(policy.bad_stack_global(module, gname, base + at))
            elif op == 0x89:  # NEWFALSE
                stack.append(False)
            elif op == 0x88:  # NEWTRUE
                stack.append(True)
            elif op == 0x4E:  # NONE
                stack.append(None)
            elif op == 0x7D:  # EMPTY_DICT
                grow(1, 0, at)
                stack.append({})
            elif op == 0x5D:  # EMPTY_LIST
                grow(1, 0, at)
                stack.append([])
            elif op == 0x8F:  # EMPTY_SET
                grow(1, 0, at)
                stack.append(set())
            elif op == 0x73:  # SETITEM
                grow(0, 1, at)
                v = pop(at)
                k = pop(at)
                target = _top(stack, base + at)
                if type(target) is dict:
                    target[hashable(k, at)] = v
                else:
                    policy.mutate(target, "SETITEM", [k, v], base + at)
            elif op == 0x75:  # SETITEMS
                items = pop_mark(at)
                target = _top(stack, base + at)
                if len(items) % 2:
                    raise _err("SETITEMS with an odd number of items", base + at)
                if type(target) is dict:
                    for i in range(0, len(items), 2):
                        target[hashable(items[i], at)] = items[i + 1]
                else:
                    policy.mutate(target, "SETITEMS", items, base + at)
            elif op == 0x61:  # APPEND
                grow(0, 1, at)
                v = pop(at)
                target = _top(stack, base + at)
                if type(target) is list:
                    target.append(v)
                else:
                    policy.mutate(target, "APPEND", [v], base + at)
            elif op == 0x65:  # APPENDS
                items = pop_mark(at)
                target = _top(stack, base + at)
                if type(target) is list:
                    target.extend(items)
                else:
                    policy.mutate(target, "APPENDS", items, base + at)
            elif op == 0x90:  # ADDITEMS
                items = pop_mark(at)
                target = _top(stack, base + at)
                if type(target) is set:
                    target.update(hashable(x, at) for x in items)
                else:
                    policy.mutate(target, "ADDITEMS", items, base + at)
            elif op == 0x62:  # BUILD
                state = pop(at)
                obj = pop(at)
                stack.append(policy.build(obj, state, base + at))
            elif op == 0x4A:  # BININT
                stack.append(_I4.unpack_from(data, take(4, at))[0])
            elif op == 0x4D:  # BININT2
                stack.append(_U2.unpack_from(data, take(2, at))[0])
            elif op == 0x8A:  # LONG1
                n = data[take(1, at)]
                p = take(n, at)
                stack.append(int.from_bytes(data[p : p + n], "little", signed=True))
            elif op == 0x8B:  # LONG4
                n = _I4.unpack_from(data, take(4, at))[0]
                if n < 0:
                    raise _err(f"LONG4 of {n} bytes", base + at)
                p = take(n, at)  # truncation first: CPython fails there too
                if n > lim.max_long_bytes:
                    raise _err(f"LONG4 of {n} bytes", base + at, LIMIT)
                stack.append(int.from_bytes(data[p : p + n], "little", signed=True))
            elif op == 0x47:  # BINFLOAT
                stack.append(_F8.unpack_from(data, take(8, at))[0])
            elif op == 0x8C:  # SHORT_BINUNICODE
                n = data[take(1, at)]
                p = take(n, at)
                stack.append(data[p : p + n].decode("utf-8", "surrogatepass"))
            elif op == 0x8D:  # BINUNICODE8
                n = _U8.unpack_from(data, take(8, at))[0]
                p = take(n, at)
                stack.append(data[p : p + n].decode("utf-8", "surrogatepass"))
            elif op in (0x42, 0x43, 0x8E, 0x96):  # BINBYTES, SHORT_BINBYTES, BINBYTES8, BYTEARRAY8
                if op == 0x42:
                    n = _U4.unpack_from(data, take(4, at))[0]
                elif op == 0x43:
                    n = data[take(1, at)]
                else:
                    n = _U8.unpack_from(data, take(8, at))[0]
                p = take(n, at)
                raw = data[p : p + n]
                stack.append(bytearray(raw) if op == 0x96 else raw)
            elif op in (0x54, 0x55):  # BINSTRING, SHORT_BINSTRING
                n = _I4.unpack_from(data, take(4, at))[0] if op == 0x54 else data[take(1, at)]
                p = take(n, at)
                stack.append(policy.text(data[p : p + n], base + at))
            elif op == 0x53:  # STRING
                raw = line(at)
                if len(raw) < 2 or raw[0] != raw[-1] or raw[:1] not in (b"'", b'"'):
                    raise _err("STRING operand is not quoted", base + at)
                stack.append(policy.text(codecs.escape_decode(raw[1:-1])[0], base + at))
            elif op == 0x56:  # UNICODE
                stack.append(line(at).decode("raw-unicode-escape"))
            elif op == 0x49:  # INT
                stack.append(_text_int(line(at), base + at))
            elif op == 0x4C:  # LONG
                stack.append(_text_long(line(at), base + at))
            elif op == 0x46:  # FLOAT
                stack.append(_text_float(line(at), base + at))
            elif op == 0x94:  # MEMOIZE
                memo[len(memo)] = _top(stack, base + at)
            elif op == 0x72:  # LONG_BINPUT
                memo[_U4.unpack_from(data, take(4, at))[0]] = _top(stack, base + at)
            elif op == 0x6A:  # LONG_BINGET
                idx = _U4.unpack_from(data, take(4, at))[0]
                stack.append(_memo_get(memo, idx, base + at))
            elif op == 0x70:  # PUT
                idx = _python_int(line(at), base + at, "PUT", 10)
                if idx < 0:
                    raise _err("negative PUT argument", base + at)
                memo[idx] = _top(stack, base + at)
            elif op == 0x67:  # GET
                idx = _python_int(line(at), base + at, "GET", 10)
                stack.append(_memo_get(memo, idx, base + at))
            elif op == 0x30:  # POP
                if stack:
                    stack.pop()
                else:
                    # CPython pops a MARK here; so do we.
                    pop_mark(at)
            elif op == 0x31:  # POP_MARK
                pop_mark(at)
            elif op == 0x32:  # DUP
                stack.append(_top(stack, base + at))
            elif op == 0x6C:  # LIST
                items = pop_mark(at)
                stack.append(items)
            elif op == 0x64:  # DICT
                items = pop_mark(at)
                if len(items) % 2:
                    raise _err("DICT with an odd number of items", base + at)
                stack.append(
                    {hashable(items[i], at): items[i + 1] for i in range(0, len(items), 2)}
                )
            elif op == 0x91:  # FROZENSET
                items = pop_mark(at)
                stack.append(frozenset(hashable(x, at) for x in items))
            elif op == 0x81:  # NEWOBJ
                args = pop(at)
                cls = pop(at)
                if type(args) is not tuple and not getattr(policy, "computed_arguments", False):
                    raise _err("NEWOBJ arguments are not a tuple", base + at)
                stack.append(policy.reduce(cls, args, base + at, "NEWOBJ"))
            elif op == 0x92:  # NEWOBJ_EX
                kwargs = pop(at)
                args = pop(at)
                cls = pop(at)
                stack.append(policy.reduce(cls, (args, kwargs), base + at, "NEWOBJ_EX"))
            elif op == 0x69:  # INST
                module = line(at).decode("utf-8")
                gname = line(at).decode("utf-8")
                cls = policy.global_(module, gname, base + at, "INST")
                items = pop_mark(at)
                stack.append(policy.reduce(cls, tuple(items), base + at, "INST"))
            elif op == 0x6F:  # OBJ
                items = pop_mark(at)
                if not items:
                    raise _err("OBJ without a class", base + at)
                stack.append(policy.reduce(items[0], tuple(items[1:]), base + at, "OBJ"))
            elif op == 0x50:  # PERSID
                pid = line(at).decode("ascii")
                stack.append(policy.persistent(pid, base + at, "PERSID"))
            elif op in (0x82, 0x83, 0x84):  # EXT1, EXT2, EXT4
                if op == 0x82:
                    code = data[take(1, at)]
                elif op == 0x83:
                    code = _U2.unpack_from(data, take(2, at))[0]
                else:
                    code = _I4.unpack_from(data, take(4, at))[0]
                stack.append(policy.extension(code, base + at))
            elif op in (0x97, 0x98):  # NEXT_BUFFER, READONLY_BUFFER
                stack.append(policy.buffer(base + at, name))
            elif op == 0x80:  # PROTO
                proto = data[take(1, at)]
                if proto > 5:
                    raise _err(f"unsupported pickle protocol {proto}", base + at)
                if at != start:
                    policy.notice("PROTO not at the start of the stream", base + at)
                policy.proto(proto, base + at)
                protocol = proto
            elif op == 0x95:  # FRAME
                n = _U8.unpack_from(data, take(8, at))[0]
                if frame_end >= 0 and pos < frame_end:
                    policy.notice("FRAME begins inside another frame", base + at)
                if pos + n > end:
                    raise _err(f"FRAME of {n} bytes runs past the end", base + at, TRUNCATED)
                frame_end = pos + n
            elif op == 0x2E:  # STOP
                if frame_end >= 0 and pos != frame_end:
                    policy.notice("STOP inside a FRAME that announces more bytes", base + at)
                value = pop(at)
                if stack or marks:
                    policy.notice("STOP leaves items on the stack", base + at)
                return Result(value, pos, protocol, ops, seen)
            else:  # pragma: no cover - OPNAMES and this switch list the same opcodes
                raise _err(f"unhandled opcode {name}", base + at)
            if len(stack) + len(marks) > lim.max_stack:
                raise _err("stack over the limit", base + at, LIMIT)
            if len(memo) > lim.max_memo:
                raise _err("memo over the limit", base + at, LIMIT)


def _opcode_offset(exc: BaseException, start: int) -> int:
    """Where the opcode that raised ``exc`` begins: the ``at`` of the machine's loop, read from
    the traceback (the loop does not store it anywhere, which would cost every opcode a
    store); ``start`` if the traceback does not show it."""
    tb = exc.__traceback__
    found = start
    while tb is not None:
        if tb.tb_frame.f_code is Machine._run.__code__:
            at = tb.tb_frame.f_locals.get("at")
            if type(at) is int:
                found = at
        tb = tb.tb_next
    return found


def _top(stack: list[Any], offset: int) -> Any:
    if not stack:
        raise _err("stack underflow", offset)
    return stack[-1]


def _memo_get(memo: dict[int, Any], idx: int, offset: int) -> Any:
    try:
        return memo[idx]
    except KeyError:
        raise _err(f"memo slot {idx} is empty", offset) from None


def decode_pickle(data: bytes, policy: Policy, start: int = 0, *, base: int = 0) -> Result:
    """Run one pickle stream of ``data`` from ``start`` (convenience wrapper)."""
    return Machine(data, policy, base=base).run(start)
