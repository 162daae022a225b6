"""LoRA adapters (PEFT's format) in the torch engine: each row of a prefill
or a batched step with its own adapter (or none) gives the tokens of
transformers + PEFT ``generate()`` with that adapter; what the engine
cannot apply is refused with a clear 400, and the engine goes on serving."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.torch
import torch
from PIL import Image

from schemas.errors import InvalidRequest, ModelNotFound
from stages.models import builtin_path
from stages.torch_engine.engine import TorchEngine
from stages.torch_engine.fused_decode import FusedKernels
from stages.torch_engine.fused_lora import PROJECTIONS
from stages.torch_engine.lora import LoraLinear
from stages.torch_engine.reference import load_reference_model, reference_generate
from stages.torch_engine.settings import DecodeSettings
from stages.torch_engine.slot_prefill import SlotPrefill
from tests.stages.engine_helpers import chat_prompt, engine_on, greedy
from tests.stages.test_batch_decode import _batched

peft = pytest.importorskip("peft")

N = 10
TARGETS = ["q_proj", "v_proj", "o_proj", "gate_proj"]
MODEL = "tiny-qwen2-vl"


def make_adapter(
    model_dir: Path, out: Path, seed: int, r: int = 4, alpha: int = 8, rslora: bool = False, **config: Any
) -> Any:
    """A PEFT adapter on the tiny model, saved to ``out``, every lora_A and
    lora_B weight random (PEFT starts B at zero: an adapter that changes
    nothing could not tell a wrong engine from a right one). Returns the
    PEFT-wrapped reference model."""
    cfg = peft.LoraConfig(r=r, lora_alpha=alpha, use_rslora=rslora, **{"target_modules": TARGETS, **config})
    with warnings.catch_warnings():
        # PEFT reads transformers' deprecated is_gradient_checkpointing.
        warnings.simplefilter("ignore", FutureWarning)
        model = peft.get_peft_model(load_reference_model(model_dir), cfg)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    model.save_pretrained(str(out))
    return model.eval()


@pytest.fixture(scope="module")
def model_dir(mmpipe_home: Path) -> Path:
    return builtin_path(MODEL)


@pytest.fixture(scope="module")
def adapters(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    """Two adapters of different seeds, ranks and scaling: name → (directory, PEFT model)."""
    root = tmp_path_factory.mktemp("lora")
    one = make_adapter(model_dir, root / "one", seed=1)
    two = make_adapter(model_dir, root / "two", seed=2, r=8, alpha=16, rslora=True)
    return {"one": (root / "one", one), "two": (root / "two", two)}


@pytest.fixture(scope="module")
def base_model(model_dir: Path) -> Any:
    return load_reference_model(model_dir)


@pytest.fixture(scope="module")
def alone(model_dir: Path, engine_device: str, adapters: Any) -> TorchEngine:
    engine = engine_on(engine_device, model_dir, DecodeSettings(batched=False))
    for name, (path, _) in adapters.items():
        engine.load_lora(name, path)
    return engine


@pytest.fixture(scope="module", params=[False, True], ids=["modules", "fused"])
def batched(model_dir: Path, engine_device: str, adapters: Any, request: pytest.FixtureRequest) -> TorchEngine:
    """The batch decoder on the model's modules (the adapters' wrappers), and
    on the fused step with prompts prefilled into their slots (a GPU's
    default: the adapters' stacked form, stages/torch_engine/fused_lora.py)."""
    engine = engine_on(engine_device, model_dir, DecodeSettings(slots=4, max_len=512, fused=request.param))
    assert (engine._slot_prefill is not None) == request.param
    for name, (path, _) in adapters.items():
        engine.load_lora(name, path)
    assert engine.decoder is not None and (engine.decoder.adapters is not None) == request.param
    return engine


def _image() -> Image.Image:
    return Image.fromarray(np.random.default_rng(1).integers(0, 256, (60, 90, 3), dtype=np.uint8))


def _prompts(engine: TorchEngine) -> list[tuple[list[int], list[Any], list[Any]]]:
    """(prompt ids, engine media, reference media) of a few prompts, one with an image."""
    texts = ["Hi", "Tell me about the sea, the sky and everything between them.", "1 2 3"]
    out: list[tuple[list[int], list[Any], list[Any]]] = [
        (list(engine.tokenizer(t)["input_ids"]), [], []) for t in texts
    ]
    content = [{"type": "image", "image": ""}, {"type": "text", "text": "What is it?"}]
    out.append((chat_prompt(engine, content), engine.encode([_image()]), [_image()]))
    return out


def _reference(model_dir: Path, model: Any, prompt: list[int], media: list[Any], n: int = N) -> list[int]:
    # PEFT wraps the model in place: its base model (with the LoRA layers) takes generate()'s every argument.
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return reference_generate(model_dir, prompt, media, n, model=inner)


def _run(engine: TorchEngine, prompt: list[int], media: list[Any], lora: str | None, n: int = N) -> list[int]:
    [(seq, first)] = engine.prefill([prompt], [media], [greedy(n)], loras=[lora])
    assert seq.lora_name == lora
    out = [first]
    while len(out) < n:
        out += engine.step([seq])
    engine.release(seq)
    return out


def test_a_prompt_alone_gives_peft_generate_tokens_and_the_adapter_changes_them(
    alone: TorchEngine, adapters: Any, base_model: Any, model_dir: Path
) -> None:
    assert alone.decoder is None and alone.loras() == ["one", "two"]
    for prompt, media, ref_media in _prompts(alone):
        base = _run(alone, prompt, media, None)
        assert base == _reference(model_dir, base_model, prompt, ref_media)
        for name, (_, model) in adapters.items():
            tokens = _run(alone, prompt, media, name)
            assert tokens == _reference(model_dir, model, prompt, ref_media), (name, prompt)
            assert tokens != base, name


def _mixed(engine: TorchEngine) -> list[tuple[list[int], list[Any], list[Any], str | None]]:
    prompts = _prompts(engine)
    loras: list[str | None] = ["one", "two", None, "two"]
    return [(p, m, r, lora) for (p, m, r), lora in zip(prompts, loras, strict=True)]


def _expected(model_dir: Path, adapters: Any, base_model: Any, jobs: list[Any], n: list[int]) -> list[list[int]]:
    models = {None: base_model, **{name: model for name, (_, model) in adapters.items()}}
    return [_reference(model_dir, models[lora], p, r, k) for (p, _, r, lora), k in zip(jobs, n, strict=True)]


@pytest.mark.parametrize("ahead", [False, True], ids=["step", "launch"])
def test_rows_of_different_adapters_step_together(
    batched: TorchEngine, adapters: Any, base_model: Any, model_dir: Path, ahead: bool
) -> None:
    """Rows of adapter one, adapter two and none in one batched step (and
    launched one step ahead, as the decode loop does), of different lengths:
    each row gives its own adapter's generate() tokens."""
    jobs = _mixed(batched)
    lengths = [N, N - 2, N - 1, N - 3]
    expected = _expected(model_dir, adapters, base_model, jobs, lengths)
    prompts = [(prompt, media) for prompt, media, _, _ in jobs]
    loras = [lora for _, _, _, lora in jobs]
    outputs, _ = _batched(batched, prompts, [greedy(k) for k in lengths], ahead, loras)
    assert [outputs[i] for i in range(len(jobs))] == expected
    assert batched._slots is not None and len(batched._slots) == 0
    assert batched.decoder is not None and batched.decoder.pool.num_free == batched.decoder.pool.capacity


def test_prompts_of_different_adapters_prefill_together(
    batched: TorchEngine, adapters: Any, base_model: Any, model_dir: Path
) -> None:
    jobs = _mixed(batched)[:3]
    expected = _expected(model_dir, adapters, base_model, jobs, [N] * 3)
    made = batched.prefill_together([(p, m, greedy(N)) for p, m, _, _ in jobs], loras=[j[3] for j in jobs])
    outputs = [[token] for _, token in made]
    seqs = [seq for seq, _ in made]
    assert [s.lora_name for s in seqs] == [j[3] for j in jobs]
    while len(outputs[0]) < N:
        for out, token in zip(outputs, batched.step(seqs), strict=True):
            out.append(token)
    for seq in seqs:
        batched.release(seq)
    assert outputs == expected


def test_a_fork_runs_its_source_s_adapter(batched: TorchEngine, adapters: Any, model_dir: Path) -> None:
    prompt, media, ref_media = _prompts(batched)[1]
    [(source, first)] = batched.prefill([prompt], [media], [greedy(N)], loras=["one"])
    source.forkable = True
    made = batched.fork(source, greedy(N))
    assert made is not None
    forked, token = made
    assert forked.lora_name == "one" and token == first
    out = [token]
    while len(out) < N:
        out += batched.step([forked])
    assert out == _reference(model_dir, adapters["one"][1], prompt, ref_media)
    batched.release(source)
    batched.release(forked)


def test_cached_prefixes_are_shared_only_with_the_same_adapter(batched: TorchEngine) -> None:
    prompt = list(batched.tokenizer(" ".join(["the sea and the sky"] * 12))["input_ids"])
    assert len(prompt) > 2 * batched.block_size
    batched.reset_prefix_cache()

    def cached(lora: str | None) -> int:
        [(seq, _)] = batched.prefill([prompt], [[]], [greedy(2)], loras=[lora])
        batched.step([seq])  # the decoder takes it: its prompt's blocks are cached
        batched.release(seq)
        return seq.cached_tokens

    assert cached("one") == 0
    assert cached("one") > 0
    assert cached(None) == 0
    assert cached("two") == 0
    assert cached("two") > 0


def test_bad_adapters_are_refused_and_the_engine_serves_on(
    model_dir: Path, engine_device: str, adapters: Any, tmp_path: Path
) -> None:
    engine = engine_on(engine_device, model_dir, DecodeSettings(batched=False))
    prompt = list(engine.tokenizer("Hi")["input_ids"])
    before = _run(engine, prompt, [], None)
    source = adapters["one"][0]

    def bad(name: str, change: Any) -> Path:
        path = tmp_path / name
        shutil.copytree(source, path)
        change(path)
        return path

    def edit_config(**fields: Any) -> Any:
        def change(path: Path) -> None:
            config = json.loads((path / "adapter_config.json").read_text())
            (path / "adapter_config.json").write_text(json.dumps({**config, **fields}))

        return change

    with pytest.raises(InvalidRequest, match=r"no adapter_config\.json"):
        engine.load_lora("x", bad("no-config", lambda p: (p / "adapter_config.json").unlink()))
    with pytest.raises(InvalidRequest, match=r"no adapter_model\.safetensors"):
        engine.load_lora("x", bad("no-weights", lambda p: (p / "adapter_model.safetensors").unlink()))
    with pytest.raises(InvalidRequest, match="bias 'all'"):
        engine.load_lora("x", bad("bias", edit_config(bias="all")))
    with pytest.raises(InvalidRequest, match="modules_to_save"):
        engine.load_lora("x", bad("save", edit_config(modules_to_save=["lm_head"])))
    with pytest.raises(InvalidRequest, match="fan_in_fan_out"):
        engine.load_lora("x", bad("fan", edit_config(fan_in_fan_out=True)))

    # An adapter on the vision tower (Qwen2-VL's blocks' attn.qkv).
    make_adapter(model_dir, tmp_path / "vision", seed=3, target_modules=["qkv", "q_proj"])
    with pytest.raises(InvalidRequest, match=r"visual\.blocks\.\d+\.attn\.qkv is not a linear layer of the language"):
        engine.load_lora("x", tmp_path / "vision")

    # lora_A of the wrong width for q_proj.
    def reshape(path: Path) -> None:
        from safetensors.torch import load_file, save_file

        tensors = load_file(str(path / "adapter_model.safetensors"))
        key = next(k for k in tensors if k.endswith("q_proj.lora_A.weight"))
        tensors[key] = torch.zeros(4, 65)
        save_file(tensors, str(path / "adapter_model.safetensors"))

    with pytest.raises(InvalidRequest, match=r"q_proj has lora_A \[4, 65\].*needs \[r, 64\]"):
        engine.load_lora("x", bad("shape", reshape))

    assert engine.loras() == []
    assert not any(isinstance(m, LoraLinear) for m in engine.model.modules())
    with pytest.raises(ModelNotFound, match="'nope' is not loaded"):
        engine.prefill([prompt], [[]], [greedy(2)], loras=["nope"])
    assert _run(engine, prompt, [], None) == before


def test_load_is_idempotent_and_unload_waits_for_the_sequences(
    model_dir: Path, engine_device: str, adapters: Any
) -> None:
    engine = engine_on(engine_device, model_dir, DecodeSettings(slots=2, max_len=256, fused=False))
    one, two = adapters["one"][0], adapters["two"][0]
    engine.load_lora("one", one)
    engine.load_lora("one", one)
    with pytest.raises(InvalidRequest, match="unload it first"):
        engine.load_lora("one", two)
    assert engine.loras() == ["one"]
    prompt = list(engine.tokenizer("Hi")["input_ids"])
    [(seq, _)] = engine.prefill([prompt], [[]], [greedy(4)], loras=["one"])
    engine.step([seq])  # in the batch decoder's row
    with pytest.raises(InvalidRequest, match="in use by 1 running"):
        engine.unload_lora("one")
    engine.release(seq)
    assert engine.unload_lora("one") and not engine.unload_lora("one")
    assert engine.loras() == []
    with pytest.raises(ModelNotFound):
        engine.prefill([prompt], [[]], [greedy(2)], loras=["one"])


def test_adapters_come_back_after_a_deep_sleep(
    model_dir: Path, engine_device: str, adapters: Any, base_model: Any
) -> None:
    engine = engine_on(engine_device, model_dir, DecodeSettings(slots=2, max_len=256, fused=False))
    engine.load_lora("two", adapters["two"][0])
    prompt = list(engine.tokenizer("Why?")["input_ids"])
    expected = _reference(model_dir, adapters["two"][1], prompt, [])
    assert _run(engine, prompt, [], "two") == expected
    engine.sleep(2)
    engine.wake_up()
    assert engine.loras() == ["two"]
    assert _run(engine, prompt, [], "two") == expected
    assert _run(engine, prompt, [], None) == _reference(model_dir, base_model, prompt, [])


def test_the_fused_step_runs_adapters_loaded_and_unloaded_while_it_serves(
    model_dir: Path, engine_device: str, adapters: Any, base_model: Any, tmp_path: Path
) -> None:
    """On the fused step (a GPU's default) a prompt of an adapter prefills
    straight into its slot and decodes with the adapter; loading one remakes
    the stacks and the graphs for the next step, while a sequence without it
    runs on; unloading the last leaves the step as it was without any. The
    second adapter covers every projection of a layer (K, up and down too:
    each fused projection whole), at another rank."""
    every = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    whole = make_adapter(model_dir, tmp_path / "whole", seed=5, r=2, alpha=3, target_modules=every)
    engine = engine_on(engine_device, model_dir, DecodeSettings(slots=4, max_len=256, fused=True))
    decoder = engine.decoder
    assert decoder is not None and decoder.adapters is None
    prompt = list(engine.tokenizer("Tell me about the sea.")["input_ids"])
    base_expected = _reference(model_dir, base_model, prompt, [])
    [(running, first)] = engine.prefill([prompt], [[]], [greedy(N)])
    base = [first, *engine.step([running])]
    engine.load_lora("two", adapters["two"][0])
    engine.load_lora("whole", tmp_path / "whole")
    assert decoder.adapters is not None and not decoder._graphs
    made = engine.prefill([prompt, prompt], [[], []], [greedy(N), greedy(N)], loras=["two", "whole"])
    assert all(seq.slot >= 0 and seq.cache is None for seq, _ in made)  # the graphed prefill, not the modules
    seqs = [seq for seq, _ in made]
    outputs = [[token] for _, token in made]
    while len(outputs[0]) < N:
        a, *rest = engine.step([running, *seqs])
        for out, token in zip(outputs, rest, strict=True):
            out.append(token)
        if len(base) < N:
            base.append(a)
    assert outputs == [
        _reference(model_dir, adapters["two"][1], prompt, []),
        _reference(model_dir, whole, prompt, []),
    ]
    assert base == base_expected and outputs[1] != base
    for seq in (*seqs, running):
        engine.release(seq)
    assert engine.unload_lora("two") and engine.unload_lora("whole") and decoder.adapters is None
    assert _run(engine, prompt, [], None) == base_expected


def test_with_max_loras_adapters_load_into_the_stacks_made_at_start(
    model_dir: Path, engine_device: str, adapters: Any, base_model: Any, tmp_path: Path
) -> None:
    """vLLM's --max-loras and --max-lora-rank: the fused step's stacks are
    made at start, before the graphs, with room for two adapters of rank 8;
    a load or an unload writes them in place (the same tensors, no graph
    dropped: on a GPU nothing is captured or compiled again), and prompts of
    each adapter and of none decode together to PEFT's and generate()'s
    tokens. Past the room, a load is refused and the engine serves on."""
    decode = DecodeSettings(slots=4, max_len=256, fused=True, max_loras=2, max_lora_rank=8)
    engine = engine_on(engine_device, model_dir, decode)
    decoder = engine.decoder
    assert decoder is not None and decoder.adapters is not None

    def stacks() -> list[torch.Tensor]:
        assert decoder.adapters is not None
        return [t for layer in decoder.adapters for name in PROJECTIONS for t in getattr(layer, name)]

    addresses, graphs = [t.data_ptr() for t in stacks()], dict(decoder._graphs)
    assert not any(t.any() for t in stacks())  # nothing loaded: every slot adds zero
    prompt = list(engine.tokenizer("Tell me about the sea.")["input_ids"])
    base = _reference(model_dir, base_model, prompt, [])
    assert _run(engine, prompt, [], None) == base
    engine.load_lora("one", adapters["one"][0])
    engine.load_lora("two", adapters["two"][0])
    assert [t.data_ptr() for t in stacks()] == addresses and decoder._graphs == graphs

    def together(loras: list[str | None]) -> list[list[int]]:
        made = engine.prefill([prompt] * len(loras), [[]] * len(loras), [greedy(N)] * len(loras), loras=loras)
        outputs = [[token] for _, token in made]
        while len(outputs[0]) < N:
            for out, token in zip(outputs, engine.step([seq for seq, _ in made]), strict=True):
                out.append(token)
        for seq, _ in made:
            engine.release(seq)
        return outputs

    one, two = (_reference(model_dir, adapters[name][1], prompt, []) for name in ("one", "two"))
    assert together(["one", None, "two"]) == [one, base, two] and one != base != two
    for name, change in (("three", {"seed": 3}), ("wide", {"seed": 4, "r": 16})):
        make_adapter(model_dir, tmp_path / name, **change)
    # "one" and the output head too (PEFT saves a tied head's own weight beside its LoRA: written here).
    shutil.copytree(adapters["one"][0], tmp_path / "head")
    weights = safetensors.torch.load_file(tmp_path / "head" / "adapter_model.safetensors")
    head = engine.model.get_output_embeddings()
    weights["base_model.model.lm_head.lora_A.weight"] = torch.randn(4, head.in_features) * 0.1
    weights["base_model.model.lm_head.lora_B.weight"] = torch.randn(head.out_features, 4) * 0.1
    safetensors.torch.save_file(weights, tmp_path / "head" / "adapter_model.safetensors")
    with pytest.raises(InvalidRequest, match="--max-loras 2"):
        engine.load_lora("three", tmp_path / "three")
    assert engine.unload_lora("one") and [t.data_ptr() for t in stacks()] == addresses
    with pytest.raises(InvalidRequest, match="past --max-lora-rank 8"):
        engine.load_lora("wide", tmp_path / "wide")
    with pytest.raises(InvalidRequest, match="output head"):
        engine.load_lora("head", tmp_path / "head")
    assert engine.loras() == ["two"] and together([None, "two"]) == [base, two]
    engine.load_lora("three", tmp_path / "three")  # into the slot "one" left
    three = _reference(model_dir, make_adapter(model_dir, tmp_path / "three-again", seed=3), prompt, [])
    assert together(["three", "two"]) == [three, two] and decoder._graphs.keys() >= graphs.keys()
    assert [t.data_ptr() for t in stacks()] == addresses


def test_an_adapter_of_an_older_layout_maps_onto_the_model(alone: TorchEngine, adapters: Any, tmp_path: Path) -> None:
    """Transformers before 4.52 named Qwen2-VL's language model ``model.layers``
    (now ``model.language_model.layers``): such an adapter's modules are found."""
    from safetensors.torch import load_file, save_file

    path = tmp_path / "old"
    shutil.copytree(adapters["one"][0], path)
    tensors = load_file(str(path / "adapter_model.safetensors"))
    renamed = {k.replace("model.language_model.layers.", "model.layers."): v for k, v in tensors.items()}
    assert renamed.keys() != tensors.keys()
    save_file(renamed, str(path / "adapter_model.safetensors"))
    alone.load_lora("old", path)
    try:
        prompt = list(alone.tokenizer("Hi")["input_ids"])
        assert _run(alone, prompt, [], "old") == _run(alone, prompt, [], "one")
    finally:
        assert alone.unload_lora("old")


# torch.compile's first use imports torch.utils.mkldnn, which warns of itself on the CPU wheel.
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_the_compiled_pieces_take_the_adapters(model_dir: Path, engine_device: str, adapters: Any) -> None:
    """The fused pieces through torch.compile (a GPU's default), the
    adapters' stacks and each row's slot among their inputs: the uncompiled
    pieces' logits, for the graphed prefill and for a step of rows of two
    adapters and none."""
    decode = DecodeSettings(slots=4, max_len=256, fused=True, torch_compile=False, cuda_graphs=False)
    engine = engine_on(engine_device, model_dir, decode)
    for name, (path, _) in adapters.items():
        engine.load_lora(name, path)
    decoder = engine.decoder
    assert decoder is not None and decoder.adapters is not None
    compiled = SlotPrefill(decoder, use_graphs=False, longest=64, compiled=True)
    eager = SlotPrefill(decoder, use_graphs=False, longest=64, compiled=False)
    prompt = engine.tokenizer("Describe the picture in three words, please.")["input_ids"]
    ids, positions, _ = engine._prepare(prompt, [], [])
    blocks = list(range(1, 1 + decoder.blocks_for(len(ids))))
    close = {"atol": 1e-4, "rtol": 1e-4} if engine_device == "cpu" else {"atol": 5e-2, "rtol": 5e-2}
    with torch.inference_mode():
        embeds = engine.family.embed_prompt(engine.model, ids, [])[0]
        for slot in (1, 2):
            want = eager.run(embeds, positions, blocks, lora=slot)
            torch.testing.assert_close(compiled.run(embeds, positions, blocks, lora=slot), want, **close)
        row = {"tokens": [5, 9, 11], "positions": [len(ids)] * 3, "lengths": [len(ids)] * 3, "lora": [1, 2, 0]}
        for r in range(3):
            decoder.set_table(r, blocks)
        want = decoder.step(**row).clone()  # type: ignore[arg-type]
        decoder.kernels = FusedKernels(compile=True, attention=decoder.kernels.attention)
        got = decoder.step(**row)  # type: ignore[arg-type]
    torch.testing.assert_close(got, want, **close)
    assert not torch.equal(want[0], want[2]) and not torch.equal(want[1], want[2])  # each adapter its own
