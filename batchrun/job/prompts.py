"""Rows to engine inputs: token ids (plain text tokenized in one call per batch) fit to the context; a bad row
gets an error and fails alone."""
from __future__ import annotations

from batchrun.job.source import Row
from batchrun.job.sections import InputSection


class PromptEncoder:
    def __init__(self, inp: InputSection, tokenizer, max_model_len: int):
        self.inp, self.tokenizer, self.max_model_len = inp, tokenizer, max_model_len

    def prepare(self, rows: list[Row]) -> None:
        """Token ids and context fit for each row without an error yet."""
        self.encode(rows)
        for row in rows:
            if not row.error:
                self.fit(row)

    def encode(self, rows: list[Row]) -> None:
        """Set token_ids (or error) on every row without an error yet; plain text is tokenized in one call."""
        texts, chats = [], []
        for row in rows:
            if row.error:
                continue
            prompt = row.prompt
            if prompt is None or (isinstance(prompt, str) and not prompt.strip()) or (
                    isinstance(prompt, list) and not prompt):
                row.error = "prompt: null or empty"
            elif isinstance(prompt, str) and not self.inp.chat:
                texts.append(row)
            else:
                chats.append(row)
        if texts:
            ids = self.tokenizer([r.prompt for r in texts]).input_ids
            for row, token_ids in zip(texts, ids):
                row.token_ids = token_ids
        for row in chats:
            messages = row.prompt if isinstance(row.prompt, list) else [{"role": "user", "content": row.prompt}]
            bad = next((i for i, m in enumerate(messages) if not isinstance(m, dict)
                        or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str)), None)
            if bad is not None:
                row.error = f"prompt: message {bad} needs a string role and content, got {messages[bad]!r}"
                continue
            if self.inp.system_prompt and not any(m.get("role") == "system" for m in messages):
                messages = [{"role": "system", "content": self.inp.system_prompt}, *messages]
            try:
                row.token_ids = list(self.tokenizer.apply_chat_template(
                    messages, add_generation_prompt=True, tokenize=True, return_dict=False))
            except Exception as exc:   # a template error is the row's problem, not the job's
                row.error = f"prompt: the chat template failed on these messages ({type(exc).__name__}: {exc})"

    def fit(self, row: Row) -> None:
        """Prompts longer than the context: truncate (input.truncate) or fail the row with a hint."""
        n = len(row.token_ids)
        if n < self.max_model_len:
            return
        keep = max(1, self.max_model_len - row.params.max_tokens)
        if self.inp.truncate == "left":
            row.token_ids = row.token_ids[-keep:]
        elif self.inp.truncate == "right":
            row.token_ids = row.token_ids[:keep]
        else:
            row.error = (f"prompt: {n} tokens does not fit the context of {self.max_model_len} tokens; "
                         f"set input.truncate: left or right to cut it")
