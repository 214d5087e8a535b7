"""The parts of a SentencePiece `.model` (a serialized ModelProto) that say how it encodes: its
pieces, model type and normalizer settings.

sentencepiece's own Python API exposes pieces and scores but not the model type or the normalizer
(the precompiled character map, dummy prefix, whitespace handling), and its generated protobuf
module needs the protobuf package, which megatrain does not depend on. The proto is small and
stable, so its few fields are read here straight from the wire format. Field numbers are those of
sentencepiece_model.proto; absent fields take that file's defaults.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

# SentencePiece.Type
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
# TrainerSpec.ModelType
UNIGRAM, BPE, WORD, CHAR = 1, 2, 3, 4


@dataclass
class Piece:
    piece: str
    score: float = 0.0
    type: int = NORMAL


@dataclass
class SpmModel:
    pieces: list[Piece] = field(default_factory=list)
    model_type: int = UNIGRAM
    byte_fallback: bool = False
    treat_whitespace_as_suffix: bool = False
    unk_id: int = 0
    precompiled_charsmap: bytes = b""
    add_dummy_prefix: bool = True
    remove_extra_whitespaces: bool = True
    escape_whitespaces: bool = True


def _fields(data: bytes) -> list[tuple[int, int | bytes]]:
    """(field number, value) in order: ints for varint and fixed-width fields (32-bit ones as raw
    bytes, for floats), bytes for length-delimited ones."""
    out: list[tuple[int, int | bytes]] = []
    pos = 0

    def varint() -> int:
        nonlocal pos
        shift = value = 0
        while True:
            if pos >= len(data):
                raise ValueError("truncated varint")
            byte = data[pos]
            pos += 1
            value |= (byte & 0x7F) << shift
            if not byte & 0x80:
                return value
            shift += 7

    while pos < len(data):
        key = varint()
        number, wire = key >> 3, key & 7
        if wire == 0:
            out.append((number, varint()))
        elif wire == 1:
            out.append((number, data[pos : pos + 8]))
            pos += 8
        elif wire == 2:
            size = varint()
            if pos + size > len(data):
                raise ValueError("truncated field")
            out.append((number, data[pos : pos + size]))
            pos += size
        elif wire == 5:
            out.append((number, data[pos : pos + 4]))
            pos += 4
        else:
            raise ValueError(f"unsupported wire type {wire}")
    return out


def _int(value: int | bytes) -> int:
    assert isinstance(value, int)
    return value - (1 << 64) if value >= 1 << 63 else value  # int32 fields: negatives are 10 bytes


def parse_spm_model(data: bytes) -> SpmModel:
    """The encoding-relevant fields of a serialized SentencePiece ModelProto; ValueError if it is not one."""
    model = SpmModel()
    for number, value in _fields(data):
        if number == 1 and isinstance(value, bytes):  # repeated SentencePiece pieces
            piece = Piece("")
            for n, v in _fields(value):
                if n == 1 and isinstance(v, bytes):
                    piece.piece = v.decode("utf-8")
                elif n == 2 and isinstance(v, bytes):
                    piece.score = struct.unpack("<f", v)[0]
                elif n == 3:
                    piece.type = _int(v)
            model.pieces.append(piece)
        elif number == 2 and isinstance(value, bytes):  # TrainerSpec
            for n, v in _fields(value):
                if n == 3:
                    model.model_type = _int(v)
                elif n == 35:
                    model.byte_fallback = bool(v)
                elif n == 24:
                    model.treat_whitespace_as_suffix = bool(v)
                elif n == 40:
                    model.unk_id = _int(v)
        elif number == 3 and isinstance(value, bytes):  # NormalizerSpec
            for n, v in _fields(value):
                if n == 2 and isinstance(v, bytes):
                    model.precompiled_charsmap = v
                elif n == 3:
                    model.add_dummy_prefix = bool(v)
                elif n == 4:
                    model.remove_extra_whitespaces = bool(v)
                elif n == 5:
                    model.escape_whitespaces = bool(v)
    if not model.pieces:
        raise ValueError("no pieces in it")
    return model
