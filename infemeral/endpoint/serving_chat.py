"""POST /v1/chat/completions: a transcript of messages, answered with the model's chat template."""

from __future__ import annotations

from infemeral.endpoint.answer import Answer
from infemeral.endpoint.schema import ChatCompletionRequest
from infemeral.endpoint.serving import OpenAIServing


class ServingChat(OpenAIServing):
    kind = "chat"
    name = "chat completion"

    def prepare(self, body: ChatCompletionRequest) -> tuple[Answer, str]:
        body.refuse_unsupported()
        self.models.check(body.model)
        messages = body.template_messages()
        params = self.sampling(body)
        prompt_ids = self.client.chat_ids(messages)
        self.check_context(prompt_ids)
        return Answer(self.pool, prompt_ids, lambda s: s.stream_messages(messages, params)), ""
