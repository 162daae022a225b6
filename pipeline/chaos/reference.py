"""What each chaos request must answer at temperature 0: transformers
``generate()`` on the served checkpoint (stages/torch_engine/reference.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.chaos.client import Job, picture


class Reference:
    def __init__(self, model_dir: str | Path) -> None:
        from transformers import AutoTokenizer

        from stages.torch_engine.reference import load_reference_model

        self.model_dir = Path(model_dir)
        self.model = load_reference_model(self.model_dir)
        self.tokenizer: Any = AutoTokenizer.from_pretrained(str(self.model_dir))
        self._texts: dict[tuple[int, int], list[str]] = {}

    def text(self, job: Job) -> list[str]:
        """generate()'s text for a greedy job, token by token as a stream
        carries it (cached per variant and length)."""
        from stages.detokenizer import IncrementalDetokenizer
        from stages.torch_engine.reference import reference_generate

        assert job.temperature == 0, "generate() is the reference of greedy requests only"
        key = (job.variant, job.max_tokens)
        if key not in self._texts:
            parts = [{"type": "image"}, {"type": "text", "text": job.prompt}]
            messages = [{"role": "user", "content": parts}]
            chat = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            prompt = self.tokenizer(chat, add_special_tokens=False)["input_ids"]
            tokens = reference_generate(
                self.model_dir, prompt, [picture(job.image)], max_new_tokens=job.max_tokens, model=self.model
            )
            detok = IncrementalDetokenizer(self.tokenizer)
            pieces = [detok.push(t) for t in tokens]
            pieces[-1] += detok.flush()
            if "".join(pieces) != self.tokenizer.decode(tokens, skip_special_tokens=True):
                raise AssertionError("the incremental detokenizer does not join up to the tokenizer's text")
            self._texts[key] = pieces
        return self._texts[key]
