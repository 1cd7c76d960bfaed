#!/usr/bin/env python3
"""Copy a Llama-family GGUF keeping only its first N transformer blocks (standard library only).

usage: cut_gguf.py IN.gguf OUT.gguf N

Every metadata key is kept (tokenizer, chat template, ...) except `<arch>.block_count`, which
becomes N. Tensors outside the blocks (token_embd, output_norm, output) and those of blk.0 to
blk.N-1 are kept, byte for byte, and re-packed at the file's alignment (GGUF v2/v3:
https://github.com/ggml-org/ggml/blob/master/docs/gguf.md). Each kept layer has the shapes it
had: a smaller model of the same geometry, for checks that need the real weights and
tokenizer but not all of the layers (SmolLM2-135M cut to 8 of its 30 layers: 47 MiB).
"""
import struct
import sys

# GGUF metadata value types with a fixed size: type id -> struct format.
FIXED = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
STRING, ARRAY, UINT32 = 8, 9, 4


class Reader:
    def __init__(self, data):
        self.data, self.at = data, 0

    def read(self, fmt):
        values = struct.unpack_from("<" + fmt, self.data, self.at)
        self.at += struct.calcsize("<" + fmt)
        return values

    def string(self):
        (length,) = self.read("Q")
        text = self.data[self.at:self.at + length]
        self.at += length
        return text

    def value(self, kind):
        """Reads one metadata value; returns it for scalars and strings, None for arrays."""
        if kind in FIXED:
            return self.read(FIXED[kind])[0]
        if kind == STRING:
            return self.string()
        if kind == ARRAY:
            (item_kind,) = self.read("I")
            (count,) = self.read("Q")
            if item_kind in FIXED:
                self.at += struct.calcsize("<" + FIXED[item_kind]) * count
            else:
                for _ in range(count):
                    self.value(item_kind)
            return None
        raise SystemExit(f"unknown GGUF metadata type {kind} at byte {self.at}")


def gguf_string(text):
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw


def cut(source, target, keep_blocks):
    data = open(source, "rb").read()
    reader = Reader(data)
    magic, version = reader.read("4sI")
    if magic != b"GGUF" or version not in (2, 3):
        raise SystemExit(f"{source}: not a GGUF v2/v3 file ({magic!r}, version {version})")
    n_tensors, n_metadata = reader.read("QQ")
    metadata, arch, alignment = [], None, 32
    for _ in range(n_metadata):
        start = reader.at
        key = reader.string().decode()
        (kind,) = reader.read("I")
        value = reader.value(kind)
        if key == "general.architecture":
            arch = value.decode()
        if key == "general.alignment":
            alignment = value
        metadata.append((key, data[start:reader.at]))
    if arch is None:
        raise SystemExit(f"{source}: no general.architecture")
    tensors = []
    for _ in range(n_tensors):
        name = reader.string().decode()
        (n_dims,) = reader.read("I")
        dims = reader.read("Q" * n_dims)
        (kind,) = reader.read("I")
        (offset,) = reader.read("Q")
        tensors.append((name, dims, kind, offset))
    data_start = -(-reader.at // alignment) * alignment
    # A tensor's bytes run to the next tensor's offset (or the end of the file).
    ends = sorted(t[3] for t in tensors) + [len(data) - data_start]
    size = {offset: ends[i + 1] - offset for i, offset in enumerate(ends[:-1])}

    def kept(name):
        return not name.startswith("blk.") or int(name.split(".")[1]) < keep_blocks

    block_count = f"{arch}.block_count"
    blocks = sum(1 for t in tensors if t[0].startswith("blk.") and t[0].endswith(".attn_norm.weight"))
    if not 0 < keep_blocks <= blocks:
        raise SystemExit(f"{source} has {blocks} blocks: N must be 1 to {blocks}")
    keep = [t for t in tensors if kept(t[0])]
    out = bytearray(struct.pack("<4sIQQ", b"GGUF", version, len(keep), len(metadata)))
    for key, raw in metadata:
        out += gguf_string(key) + struct.pack("<II", UINT32, keep_blocks) if key == block_count else raw
    offset, payload = 0, []
    for name, dims, kind, old in keep:
        out += gguf_string(name) + struct.pack("<I", len(dims)) + struct.pack("<" + "Q" * len(dims), *dims)
        out += struct.pack("<IQ", kind, offset)
        payload.append((offset, data[data_start + old:data_start + old + size[old]]))
        offset = -(-(offset + size[old]) // alignment) * alignment
    out += b"\0" * (-len(out) % alignment)
    base = len(out)
    out += b"\0" * offset
    for at, raw in payload:
        out[base + at:base + at + len(raw)] = raw
    with open(target, "wb") as f:
        f.write(out)
    print(f"{target}: {blocks} -> {keep_blocks} blocks, {len(keep)} of {len(tensors)} tensors, "
          f"{len(out) / 2**20:.1f} MiB")


if __name__ == "__main__":
    if len(sys.argv) != 4:
        raise SystemExit(__doc__)
    cut(sys.argv[1], sys.argv[2], int(sys.argv[3]))
