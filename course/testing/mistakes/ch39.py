"""Chapter 39: the GGUF reader (metadata values, dequantization, the rotary row order)."""
from . import Mistake

MILESTONE = "tests/test_ch39_checkpoint_formats.py"
METADATA = f"{MILESTONE}::test_header_metadata_and_tensor_table"
NIBBLES = f"{MILESTONE}::test_unpack_nibbles_order"
ROPE = f"{MILESTONE}::test_undo_rope_permutation"
TABLES = (MILESTONE, "-k", "header_metadata or not_a_gguf or past_the_end or alignment_comes")


def dequantized(kind: str) -> str:
    return f"{MILESTONE}::test_dequantization_is_bit_exact[{kind}]"


MISTAKES = [
    Mistake("gguf.py", "unpack_nibbles",
            before="torch.cat([packed & 0x0F, packed >> 4], dim=1)",
            after="torch.stack([packed & 0x0F, packed >> 4], dim=2).reshape(packed.shape[0], -1)",
            rule="ggml's order: the low nibbles of bytes 0-15 first, then their high nibbles (not interleaved)",
            expect="the low nibbles of bytes 0-15 are values 0-15", tests=(NIBBLES,)),
    Mistake("gguf.py", "GGUFFile._read_tables",
            before="self.data_start = -(-offset // self.alignment) * self.alignment",
            after="self.data_start = offset",
            rule="the data section starts on the alignment, after the padding that follows the tensor table",
            expect="alignment the file sets", tests=TABLES),
    Mistake("gguf.py", "GGUFFile._read_tables",
            before='self.alignment = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))',
            after="self.alignment = DEFAULT_ALIGNMENT",
            rule="the alignment is general.alignment when the metadata sets it (32 only by default)",
            expect="which the metadata sets", tests=TABLES),
    Mistake("gguf.py", "GGUFFile._read_tables",
            before="tuple(reversed(dims))",
            after="tuple(dims)",
            rule="the file lists dims fastest-varying first; a shape is their reverse",
            expect="fastest-first", tests=TABLES),
    Mistake("gguf.py", "GGUFFile._read_tables",
            before="GGUFTensorInfo(name, shape, type_id, self.data_start + relative)",
            after="GGUFTensorInfo(name, shape, type_id, relative)",
            rule="a tensor's offset in the table counts from the data section; the info's offset is absolute",
            expect="counts from the aligned start", tests=TABLES),
    Mistake("gguf.py", "GGUFFile._read_tables",
            before="info.offset + info.nbytes > len(self._map)",
            after="info.offset > len(self._map)",
            rule="a tensor whose bytes run past the end of the file is refused when the file is opened",
            expect="runs past the end", tests=TABLES),
    Mistake("gguf.py", "GGUFFile._read_tables",
            before="if self.version not in (2, 3):",
            after="if self.version < 2:",
            rule="a version this reader does not know is refused, naming it",
            expect="version 4", tests=TABLES),
    Mistake("gguf.py", "unpack_nibbles",
            before="[packed & 0x0F, packed >> 4]",
            after="[packed >> 4, packed & 0x0F]",
            rule="the low nibbles are the first 16 values",
            expect="the low nibbles of bytes 0-15 are values 0-15", tests=(NIBBLES,)),
    Mistake("gguf.py", "unpack_nibbles",
            before="dim=1).to(torch.int16)",
            after="dim=1)",
            rule="the values come back as int16, so Q4_0's q - 8 does not wrap around",
            expect="returns int16", tests=(NIBBLES,)),
    Mistake("gguf.py", "read_value",
            before='(length,) = struct.unpack_from("<Q", buffer, offset)\n        start = offset + 8',
            after='(length,) = struct.unpack_from("<I", buffer, offset)\n        start = offset + 4',
            rule="a string's length is a u64",
            expect="a string is a u64 byte length", tests=(METADATA,)),
    Mistake("gguf.py", "read_value",
            before='element_type, count = struct.unpack_from("<IQ", buffer, offset)\n        offset += 12',
            after='element_type, count = struct.unpack_from("<II", buffer, offset)\n        offset += 8',
            rule="an array's count is a u64 (after a u32 element type)",
            expect="a u64 count", tests=(METADATA,)),
    Mistake("gguf.py", "read_value",
            before="return struct.unpack_from(fmt, buffer, offset)[0]",
            after='return struct.unpack_from(">" + fmt[1:], buffer, offset)[0]',
            rule="every number is little-endian, whatever the machine",
            expect="little-endian", tests=(METADATA,)),
    Mistake("gguf.py", "read_value",
            before="return struct.unpack_from(fmt, buffer, offset)[0]",
            after="return struct.unpack_from(fmt.replace('?', 'B'), buffer, offset)[0]",
            rule="a bool value is returned as a Python bool",
            expect="a bool is a bool", tests=(METADATA,)),
    Mistake("gguf.py", "dequantize_q8_0",
            before="view(torch.int8)",
            after="view(torch.uint8)",
            rule="Q8_0's quants are signed int8",
            expect="signed int8", tests=(dequantized("Q8_0"),)),
    Mistake("gguf.py", "dequantize_q8_0",
            before="blocks = _blocks(data, 34)",
            after="blocks = _blocks(data, 32)",
            rule="a Q8_0 block is 34 bytes: the 2-byte scale, then 32 quants",
            expect="34-byte block", tests=(dequantized("Q8_0"),)),
    Mistake("gguf.py", "dequantize_q8_0",
            before="quants = blocks[:, 2:]",
            after="quants = blocks[:, :32]",
            rule="the quants follow the 2-byte scale",
            expect="then 32 signed int8 quants", tests=(dequantized("Q8_0"),)),
    Mistake("gguf.py", "dequantize_q4_1",
            before="+ _halves(blocks, 2)",
            after="- _halves(blocks, 2)",
            rule="Q4_1's value is d * q + m: the minimum is added",
            expect="value = d * q + m", tests=(dequantized("Q4_1"),)),
    Mistake("gguf.py", "dequantize_q4_1",
            before="(_halves(blocks, 0) * unpack_nibbles",
            after="(_halves(blocks, 2) * unpack_nibbles",
            rule="the scale d is the first float16 of the block, the minimum m the second",
            expect="a float16 scale d, a float16 minimum m", tests=(dequantized("Q4_1"),)),
    Mistake("gguf.py", "dequantize_q4_1",
            before="unpack_nibbles(blocks[:, 4:])",
            after="unpack_nibbles(blocks[:, 2:18])",
            rule="the nibbles follow both float16s (bytes 4-19)",
            expect="then 16 bytes of nibbles", tests=(dequantized("Q4_1"),)),
    Mistake("gguf.py", "undo_rope_permutation",
            before="weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])",
            after="weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:])",
            rule="undo the converter's permutation, do not apply it again",
            expect="within every head", tests=(ROPE,)),
    Mistake("gguf.py", "undo_rope_permutation",
            before="weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])",
            after="weight.reshape(1, rows // 2, 2, *weight.shape[1:])",
            rule="rows move within each head, never across heads",
            expect="within every head", tests=(ROPE,)),
    Mistake("gguf.py", "undo_rope_permutation",
            before=".transpose(1, 2)",
            after="",
            rule="the file's rows are reordered, not kept",
            expect="within every head", tests=(ROPE,)),
]

DECIDES = {
    "read_value":
        "how to read a self-describing typed value whose arrays hold values of any type (nested too), returning "
        "where the next one starts",
    "GGUFFile._read_tables":
        "how to walk the file's header, metadata and tensor table with one cursor, and how to place the tensors "
        "once the table's end and the metadata's alignment are known",
    "unpack_nibbles":
        "how to split packed bytes into their two 4-bit halves in ggml's order (all low halves, then all high) "
        "with whole-tensor operations",
    "dequantize_q8_0":
        "how to see every block as a row so its float16 scale and signed quants are column slices, reinterpreted "
        "rather than converted",
    "dequantize_q4_1":
        "how to apply a block's scale and minimum to its 32 nibbles for all blocks at once, reusing "
        "unpack_nibbles",
    "undo_rope_permutation":
        "which permutation undoes llama.cpp's row order inside every head, and how to apply it to dense weights, "
        "biases and quantized block rows alike",
}

DESIGN = ("GGUFFile._read_tables",)
