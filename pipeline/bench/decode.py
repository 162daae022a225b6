"""``mmpipe bench decode``: the batch decoder against plain transformers
``generate()`` and the memory-bandwidth roofline, in one run on one GPU.

For each preset (real-size shapes, random bf16 weights) and batch size: a
prompt of ``--context`` tokens per row; ``generate()`` with 1 and with
``--new-tokens`` new tokens (a step = the difference / (new tokens - 1): what one more token
costs, the prompt's forward taken out); then the same
prompts prefilled once and decoded by the batch decoder (CUDA graphs, or
eager with ``--no-cuda-graphs``), timed over the same number of steps. A
step must read every weight of the language model and every row's KV cache:
bytes / the card's peak bandwidth is the roofline step time.

Needs only torch, transformers and this package's
stages.torch_engine.batch_decoder and stages.models (msgspec): it runs where
the rest of mmpipe is not installed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from typing import Any

from pipeline.bench.results import write_json

PEAK_HBM_BYTES_PER_S = {"H200": 4.8e12, "H100": 3.35e12}
# Runs of the plain step and of the step with penalties and logprobs, in turns.
EXTRAS_ROUNDS = 5


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--presets", default="qwen2-vl-2b,qwen2-vl-7b")
    p.add_argument("--batches", default="1,8,32", help="comma-separated batch sizes")
    p.add_argument("--context", type=int, default=296, help="prompt tokens per row")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument(
        "--max-len", type=int, default=0, help="tokens one sequence may hold (default: context + new tokens + 1)"
    )
    p.add_argument("--repeats", type=int, default=3, help="timed runs of each (median)")
    p.add_argument(
        "--lora-adapters",
        type=int,
        default=4,
        help="random LoRA adapters (rank 16) spread over the rows, for the modules' and the fused step with "
        "adapters (0: skip)",
    )
    p.add_argument(
        "--chunk",
        type=int,
        default=512,
        help="tokens of a long prompt's chunk (its second, past one as long) run in a step (a mixed step), "
        "against the step and the chunk alone (0: skip)",
    )
    p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false")
    p.add_argument("--no-baseline", dest="baseline", action="store_false", help="skip generate()")
    p.add_argument("--output", default="", metavar="FILE", help="also write the results here, as JSON")
    p.add_argument("--profile", action="store_true", help="print the kernels of a few decoder steps (torch.profiler)")
    p.add_argument(
        "--attention",
        choices=("triton", "sdpa", "compiled"),
        default=None,
        help="the fused step's attention (default: the decoder's)",
    )
    p.add_argument(
        "--linear", choices=("cublas", "triton"), default=None, help="the projections' kernel (default: the decoder's)"
    )
    p.add_argument(
        "--compile-mode", default=None, help="torch.compile mode of the fused step (e.g. max-autotune-no-cudagraphs)"
    )


def main(args: argparse.Namespace) -> int:
    import torch
    import transformers

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = next((bw for key, bw in PEAK_HBM_BYTES_PER_S.items() if key in name), None)
    results: dict[str, Any] = {
        "device": name,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peak_hbm_bytes_per_s": peak,
        "context": args.context,
        "new_tokens": args.new_tokens,
        "cuda_graphs": args.cuda_graphs and device.type == "cuda",
        "runs": [],
    }
    print(f"mmpipe bench decode  device={name}  torch={torch.__version__}  transformers={transformers.__version__}")
    print(f"context={args.context}  new_tokens={args.new_tokens}  cuda_graphs={results['cuda_graphs']}", flush=True)
    batches = [int(b) for b in args.batches.split(",")]
    for preset in args.presets.split(","):
        results["runs"] += _preset(preset, batches, args, device, peak)
    _table(results)
    write_json(results, args.output, "bench_decode.json")
    return 0


def _preset(preset: str, batches: list[int], args: argparse.Namespace, device: Any, peak: float | None) -> list[Any]:
    import torch

    from stages.models.presets import build_preset_model
    from stages.torch_engine.batch_decoder import BatchDecoder
    from stages.torch_engine.fused_decode import FusedKernels

    model = build_preset_model(preset, str(device))
    weights = _weight_bytes(model)
    text = model.config.text_config
    head_dim = text.hidden_size // text.num_attention_heads
    kv_per_token = 2 * text.num_hidden_layers * text.num_key_value_heads * head_dim * 2
    runs = []
    for batch in batches:
        ids = torch.randint(0, 150_000, (batch, args.context), generator=torch.Generator().manual_seed(batch))
        ids = ids.to(device)
        row: dict[str, Any] = {"preset": preset, "batch": batch}
        if args.baseline:
            row["generate_step_ms"] = _generate_step_ms(model, ids, args.new_tokens, args.repeats, device)
        decoder = BatchDecoder(
            model,
            max_slots=batch,
            max_len=args.max_len or args.context + args.new_tokens + 1,
            use_graphs=args.cuda_graphs,
        )
        if decoder.fused is not None and (args.attention or args.compile_mode or args.linear):
            decoder.kernels = FusedKernels(
                compile=device.type == "cuda",
                attention=args.attention or decoder.kernels.attention,
                mode=args.compile_mode,
                linear=args.linear or decoder.kernels.linear,
            )
        timed = (model, decoder, ids, args.new_tokens, args.repeats, device)
        row["decoder_step_ms"], ahead_tokens = _decoder_step_ms(*timed, ahead=True)
        # Each step's tokens read before the next is launched: what one step ahead saves.
        row["decoder_sync_step_ms"], sync_tokens = _decoder_step_ms(*timed, ahead=False)
        # The same steps either way: tokens fed on the device are the ones read back.
        row["ahead_tokens_equal"] = ahead_tokens == sync_tokens
        # Every row with OpenAI's penalties, a repetition penalty, a logit bias and
        # 5 logprobs, applied and reported in the step (stages/torch_engine/row_sampling.py).
        # Plain and extras runs taken in turns (a step's time drifts by more than
        # the extras cost between runs minutes apart), each side's median.
        # And every row sampling (temperature, top-k, top-p, a seed each) in the step.
        plain, extra, sampled = [], [], []
        for _ in range(EXTRAS_ROUNDS):
            plain.append(_decoder_step_ms(*timed[:4], 1, device, ahead=True)[0])
            extra.append(_decoder_step_ms(*timed[:4], 1, device, ahead=True, extras="penalties")[0])
            sampled.append(_decoder_step_ms(*timed[:4], 1, device, ahead=True, extras="sampling")[0])
        row["decoder_paired_step_ms"] = statistics.median(plain)
        row["decoder_extras_step_ms"] = statistics.median(extra)
        row["extras_overhead"] = row["decoder_extras_step_ms"] / row["decoder_paired_step_ms"] - 1
        row["decoder_sampled_step_ms"] = statistics.median(sampled)
        row["sampling_overhead"] = row["decoder_sampled_step_ms"] / row["decoder_paired_step_ms"] - 1
        if args.lora_adapters:
            row.update(_lora_step(model, ids, args, device))
        if args.chunk:
            row.update(_mixed_step(model, ids, args, device))
        if args.profile:
            _profile(decoder, ids, args.context)
        row["greedy_agree"] = _agreement(model, decoder, ids[:1], args.new_tokens) if batch == batches[0] else None
        del decoder
        kv = kv_per_token * batch * (args.context + args.new_tokens / 2)  # mean context over the steps
        row["bytes_per_step"] = int(weights + kv)
        if peak:
            row["roofline_step_ms"] = (weights + kv) / peak * 1e3
            row["roofline_fraction"] = row["roofline_step_ms"] / row["decoder_step_ms"]
        row["decoder_tok_s"] = batch * 1e3 / row["decoder_step_ms"]
        if args.baseline:
            row["generate_tok_s"] = batch * 1e3 / row["generate_step_ms"]
            row["speedup"] = row["generate_step_ms"] / row["decoder_step_ms"]
        runs.append(row)
        print(json.dumps(row), flush=True)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return runs


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Any, device: Any, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _generate_step_ms(model: Any, ids: Any, new: int, repeats: int, device: Any) -> float:
    import torch

    def run(n: int) -> Any:
        with torch.inference_mode():
            return model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
            )

    one = _timed(lambda: run(1), device, repeats)
    full = _timed(lambda: run(new), device, repeats)
    return (full - one) / (new - 1)


def _prefill(model: Any, ids: Any) -> tuple[list[Any], list[int]]:
    """Each row's cache (per layer keys and values) and next token, prefilled alone."""
    import torch

    caches, firsts = [], []
    with torch.inference_mode():
        for row in ids:
            out = model(input_ids=row[None], use_cache=True, logits_to_keep=1)
            cache = getattr(out, "cache", None) or out.past_key_values
            caches.append([(layer.keys, layer.values) for layer in cache.layers])
            firsts.append(int(out.logits[0, -1].argmax()))
    return caches, firsts


def _decoder_step_ms(
    model: Any,
    decoder: Any,
    ids: Any,
    new: int,
    repeats: int,
    device: Any,
    ahead: bool,
    extras: str | None = None,
    lora: tuple[Any, list[int]] | None = None,
) -> tuple[float, list[list[int]]]:
    """ms per step of the batch decoder, and the tokens of each step. ``ahead``:
    as the decode loop runs it (TorchEngine.launch/collect), step k+1
    launched before step k's tokens are read, its tokens fed from the
    device; else each step's tokens are read before the next is launched.
    ``extras``: "penalties", every row with penalties, a bias and 5
    logprobs, read as the engine reads them; "sampling", every row drawing
    its token (temperature, top-k, top-p, its own seed). ``lora``: the
    adapters (a LoraSet) and each row's adapter slot, as the engine steps them."""
    from stages.sampling import SamplingConfig
    from stages.torch_engine.batch_decoder import StepInputs
    from stages.torch_engine.sampling import draw_key

    batch, context = ids.shape
    caches, firsts = _prefill(model, ids)
    rows, none, zeros, ones = list(range(batch)), [-1] * batch, [0] * batch, [1] * batch
    blocks = _seat(decoder, batch, context + new)
    if extras == "sampling":
        for r in rows:
            decoder.set_sampling(r, SamplingConfig(temperature=0.8, top_k=50, top_p=0.95, seed=r), [])
    elif extras:
        for r in rows:
            config = SamplingConfig(
                presence_penalty=0.5,
                frequency_penalty=0.5,
                repetition_penalty=1.1,
                prompt_ids=tuple(sorted(set(ids[r].tolist()))),
                logit_bias=((11, 2.0), (13, -5.0)),
                logprobs=5,
            )
            decoder.set_sampling(r, config, [])

    def read(launched: Any) -> list[int]:
        tokens: list[int] = launched.tokens()
        if extras == "penalties":
            for r in rows:
                launched.logprobs(r, 5)
        return tokens

    def run() -> list[list[int]]:
        for row, layers in enumerate(caches):
            decoder.load(blocks[row], layers)
        tokens, seen = list(firsts), []
        launched: Any = None
        for step in range(new - 1):
            lengths = [context + step] * batch
            feed = rows if ahead and step > 0 else none
            block = [blocks[r][lengths[r] // decoder.block_size] for r in rows]
            draws = [draw_key(r, step + 1) for r in rows] if extras == "sampling" else zeros
            slots = lora[1] if lora is not None else zeros
            inputs = StepInputs(tokens, lengths, lengths, feed, zeros, ones, block, draws, slots)
            with lora[0].for_step(decoder.lora, slots, decoder.use_graphs) if lora else contextlib.nullcontext():
                previous, launched = (
                    launched,
                    decoder.launch(inputs, extras=extras == "penalties", samples=extras == "sampling"),
                )
            if not ahead:
                tokens = read(launched)
                seen.append(tokens)
            elif previous is not None:
                seen.append(read(previous))
        if ahead and launched is not None:
            seen.append(read(launched))
        return seen

    total = _timed(run, device, repeats)
    # Loading the caches is part of the run: take it out.
    load = _timed(lambda: [decoder.load(blocks[r], layers) for r, layers in enumerate(caches)], device, repeats)
    seen = run()
    _unseat(decoder, blocks)
    return (total - load) / (new - 1), seen


# The rank of the random adapters `--lora-adapters` spreads over the rows.
LORA_RANK = 16


def _lora_step(model: Any, ids: Any, args: argparse.Namespace, device: Any) -> dict[str, float]:
    """The batch decoder's step with every row running one of
    ``--lora-adapters`` random adapters (rank 16, on every projection of the
    language model), against the same step before any adapter was loaded:
    on the model's modules (the adapters' wrappers, ``LoraLinear``) and on
    the fused step (a GPU's default; the adapters' stacked form,
    stages/torch_engine/fused_lora.py; on a CPU too, so the path runs)."""
    from pathlib import Path

    import torch

    from stages.torch_engine.batch_decoder import BatchDecoder
    from stages.torch_engine.lora import LoraAdapter, LoraLinear, LoraSet, LoraWeights, language_linears

    batch, context = ids.shape
    max_len = args.max_len or context + args.new_tokens + 1
    decoders = {
        kind: BatchDecoder(model, max_slots=batch, max_len=max_len, use_graphs=args.cuda_graphs, fused=kind == "fused")
        for kind in ("modules", "fused")
    }
    plain = {kind: _decoder_step_ms(model, d, ids, args.new_tokens, args.repeats, device, ahead=True)[0]
             for kind, d in decoders.items()}  # fmt: skip
    head = model.get_output_embeddings()
    targets = {name: m for name, m in language_linears(model).items() if m is not head}
    generator = torch.Generator().manual_seed(0)
    loras = LoraSet()
    for k in range(args.lora_adapters):
        modules = {
            name: LoraWeights(
                torch.randn(LORA_RANK, m.in_features, generator=generator) * 0.01,
                torch.randn(m.out_features, LORA_RANK, generator=generator) * 0.01,
                2.0,
            )
            for name, m in targets.items()
        }
        loras.add(LoraAdapter(f"bench-{k}", Path("."), modules, salt=""))
    loras.apply(model)
    decoders["fused"].adapters = loras.fused(model)
    out: dict[str, float] = {}
    seen: dict[str, list[list[int]]] = {}
    try:
        slots = [1 + row % args.lora_adapters for row in range(batch)]
        for kind, decoder in decoders.items():
            decoder.forget_graphs()
            timed = (model, decoder, ids, args.new_tokens, args.repeats, device)
            with_lora, seen[kind] = _decoder_step_ms(*timed, ahead=True, lora=(loras, slots))
            # The modules' keys as they were before the fused step took adapters.
            named = "" if kind == "modules" else "fused_"
            out[f"decoder_{kind}_step_ms"] = plain[kind]
            out[f"decoder_{named}lora_step_ms"] = with_lora
            out[f"lora_{named}overhead"] = with_lora / plain[kind] - 1
        # The two forms' greedy tokens, step by step (equal on a CPU; bf16 rounds each its own way).
        pairs = [(a, b) for x, y in zip(seen["modules"], seen["fused"], strict=True) for a, b in zip(x, y, strict=True)]
        out["lora_fused_agree"] = sum(a == b for a, b in pairs) / len(pairs)
        # --max-loras: the fused stacks with room for as many adapters of rank 16, none
        # loaded (every row slot 0): what the room reserved at start costs a step.
        fused = decoders["fused"]
        fused.adapters = LoraSet().fused(model, reserved=(args.lora_adapters, LORA_RANK))
        fused.forget_graphs()
        reserved = _decoder_step_ms(model, fused, ids, args.new_tokens, args.repeats, device, ahead=True)[0]
        out["decoder_fused_reserved_step_ms"] = reserved
        out["lora_reserved_overhead"] = reserved / plain["fused"] - 1
    finally:
        # The wrappers off again: the model goes on to the next batch size plain.
        for name, module in list(model.named_modules()):
            if isinstance(module, LoraLinear):
                parent, _, child = name.rpartition(".")
                setattr(model.get_submodule(parent) if parent else model, child, module.base)
        del decoders
    return out


def _mixed_step(model: Any, ids: Any, args: argparse.Namespace, device: Any) -> dict[str, float]:
    """A decode step of every row carrying a chunk of ``--chunk`` tokens of a
    long prompt (its second: its rows attend over the first's blocks too),
    in one forward (``BatchDecoder.step(chunk=...)``, as the engine runs a
    chunk beside running sequences), against the step alone (a CUDA graph
    where graphs are on) plus the same chunk alone (``SlotPrefill.run(chunk=True)``,
    as a chunk between two steps ran): what a running row's next token
    waits for while a long prompt prefills, each way."""
    import torch

    from stages.torch_engine.batch_decoder import BLOCK_SIZE, BatchDecoder
    from stages.torch_engine.block_pool import blocks_for
    from stages.torch_engine.slot_prefill import SlotPrefill

    batch, context = ids.shape
    chunk = args.chunk
    max_len = max(args.max_len or context + args.new_tokens + 1, 2 * chunk)
    # The rows' blocks, the prompt's and the null block.
    blocks = batch * blocks_for(context + 1, BLOCK_SIZE) + blocks_for(2 * chunk, BLOCK_SIZE) + 1
    decoder = BatchDecoder(
        model, max_slots=batch, max_len=max_len, use_graphs=args.cuda_graphs, fused=True, num_blocks=blocks
    )
    if decoder.fused is None:
        return {}
    prefill = SlotPrefill(decoder, use_graphs=False, longest=chunk)
    if prefill.max_tokens < chunk:
        return {}
    seated = _seat(decoder, batch, context + 1)
    prompt = decoder.pool.allocate(decoder.blocks_for(2 * chunk))
    generator = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        embeds = model.get_input_embeddings()(torch.randint(0, 150_000, (chunk,), generator=generator).to(device))
    positions = torch.arange(chunk, 2 * chunk, device=device)[None]
    tokens, lengths = ids[:, -1].tolist(), [context] * batch
    repeats = max(args.repeats, 10)
    try:
        with torch.inference_mode():
            prefill.run(embeds, positions - chunk, prompt, chunk=True)  # the first chunk, once
            step = _timed(lambda: decoder.step(tokens, lengths, lengths), device, repeats)
            alone = _timed(lambda: prefill.run(embeds, positions, prompt, start=chunk, chunk=True), device, repeats)

            def mixed() -> Any:
                return decoder.step(
                    tokens, lengths, lengths, chunk=prefill.chunk_rows(embeds, positions, prompt, chunk)
                )

            both = _timed(mixed, device, repeats)
            # The rows' choices either way (alike on a CPU; bf16 sums round by the matrices' shapes).
            agree = (mixed().argmax(-1) == decoder.step(tokens, lengths, lengths).argmax(-1)).float().mean().item()
            graphed = None
            if decoder.use_graphs:
                # As the engine runs it with graphs: right after the step, its span's graph.
                graphs = SlotPrefill(decoder, use_graphs=True, longest=chunk)
                graphs.chunk_tokens = chunk
                graphed = _timed(
                    lambda: graphs.run(embeds, positions, prompt, start=chunk, chunk=True), device, repeats
                )
                del graphs
    finally:
        decoder.pool.free(prompt)
        _unseat(decoder, seated)
    out = {
        "chunk_tokens": chunk,
        "decoder_plain_step_ms": step,
        "chunk_alone_ms": alone,
        "mixed_step_ms": both,
        # < 1: the running rows' next token comes sooner in a mixed step.
        "mixed_vs_step_and_chunk": both / (step + alone),
        "mixed_step_agree": agree,
    }
    if graphed is not None:
        out["chunk_graph_ms"] = graphed
        out["step_and_chunk_graph_vs_mixed"] = (step + graphed) / both
    return out


def _seat(decoder: Any, batch: int, tokens: int) -> list[list[int]]:
    """Rows 0..batch-1 of the decoder, each with blocks for ``tokens`` positions."""
    seated = []
    for row in range(batch):
        blocks = decoder.pool.allocate(decoder.blocks_for(tokens))
        decoder.set_table(row, blocks)
        seated.append(blocks)
    return seated


def _unseat(decoder: Any, seated: list[list[int]]) -> None:
    for row, blocks in enumerate(seated):
        decoder.clear_row(row)
        decoder.pool.free(blocks)


def _profile(decoder: Any, ids: Any, context: int) -> None:
    from torch.profiler import ProfilerActivity, profile

    batch = ids.shape[0]
    tokens = ids[:, -1].tolist()
    seated = _seat(decoder, batch, context + 1)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            decoder.step(tokens, [context] * batch, [context] * batch)
        _sync(ids.device)
    _unseat(decoder, seated)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25), flush=True)


def _agreement(model: Any, decoder: Any, ids: Any, new: int) -> float:
    """Share of steps where the decoder's next token is generate()'s, fed
    generate()'s tokens (teacher-forced: one rounding difference does not
    count twice). bf16 on random weights gives flat logits: near-ties are
    common, so this is a check of the arithmetic, not of bit-exactness."""
    import torch

    with torch.inference_mode():
        want = model.generate(input_ids=ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
    want = want[0, ids.shape[1] :].tolist()
    caches, firsts = _prefill(model, ids)
    seated = _seat(decoder, 1, ids.shape[1] + new)
    decoder.load(seated[0], caches[0])
    same = int(firsts[0] == want[0])
    length = ids.shape[1]
    for i in range(1, new):
        token = int(decoder.step([want[i - 1]], [length], [length])[0].argmax())
        same += int(token == want[i])
        length += 1
    _unseat(decoder, seated)
    return same / new


def _weight_bytes(model: Any) -> int:
    """Weights a decode step reads: decoder layers, final norm, lm_head (vision untouched)."""
    total = sum(
        p.numel() * p.element_size()
        for name, p in model.model.language_model.named_parameters()
        if not name.startswith("embed_tokens")
    )
    return total + model.lm_head.weight.numel() * model.lm_head.weight.element_size()


def _table(results: dict[str, Any]) -> None:
    print()
    print(
        f"{'preset':<12} {'batch':>5} {'generate ms/step':>17} {'decoder ms/step':>16} {'read each ms':>13} "
        f"{'speedup':>8} {'extras':>7} {'sampling':>8} {'lora':>7} {'lora fused':>10} {'lora room':>9} "
        f"{'mixed/step+chunk':>16} {'chunk graph ms':>14} "
        f"{'generate tok/s':>15} {'decoder tok/s':>14} {'roofline ms':>12} {'of roofline':>12} {'greedy agree':>13}"
    )
    for r in results["runs"]:
        print(
            f"{r['preset']:<12} {r['batch']:>5} {r.get('generate_step_ms', float('nan')):>17.3f} "
            f"{r['decoder_step_ms']:>16.3f} {r['decoder_sync_step_ms']:>13.3f} {r.get('speedup', float('nan')):>8.2f} "
            f"{r['extras_overhead']:>+7.1%} {r['sampling_overhead']:>+8.1%} "
            f"{r.get('lora_overhead', float('nan')):>+7.1%} {r.get('lora_fused_overhead', float('nan')):>+10.1%} "
            f"{r.get('lora_reserved_overhead', float('nan')):>+9.1%} "
            f"{r.get('mixed_vs_step_and_chunk', float('nan')):>16.2f} {r.get('chunk_graph_ms', float('nan')):>14.2f} "
            f"{r.get('generate_tok_s', float('nan')):>15.1f} {r['decoder_tok_s']:>14.1f} "
            f"{r.get('roofline_step_ms', float('nan')):>12.3f} {r.get('roofline_fraction', float('nan')):>12.1%} "
            f"{'' if r['greedy_agree'] is None else format(r['greedy_agree'], '.0%'):>13}"
        )


if __name__ == "__main__":  # python -m pipeline.bench.decode: on a GPU host without the rest of mmpipe
    parser = argparse.ArgumentParser(prog="python -m pipeline.bench.decode", description=__doc__.split("\n")[0])
    add_arguments(parser)
    raise SystemExit(main(parser.parse_args()))
