"""POST /v1/completions: raw text (or token ids) continued without a chat template."""

from __future__ import annotations

from infemeral.client.sampling import SamplingParams
from infemeral.endpoint.schema import CompletionRequest, RequestError
from infemeral.endpoint.serving import OpenAIServing


class ServingCompletion(OpenAIServing):
    kind = "completion"
    name = "completion"

    def prompt(self, body: CompletionRequest, params: SamplingParams):
        """The prompt as text or token ids, shown again before the answer when the request asks (`echo`)."""
        prompt = body.single_prompt()
        if isinstance(prompt, str):
            prompt_ids = self.client.text_ids(prompt)
            if not prompt_ids:
                raise RequestError(400, "the prompt is empty", param="prompt")
        else:
            vocab = self.client.model.config.vocab_size
            if any(not 0 <= t < vocab for t in prompt):
                raise RequestError(400, f"token ids must be in [0, {vocab})", param="prompt")
            prompt_ids = list(prompt)
        echo = (prompt if isinstance(prompt, str) else self.client.tokenizer.decode(prompt_ids)) if body.echo else ""
        return prompt_ids, lambda session: session.stream_raw(prompt_ids, params), echo
