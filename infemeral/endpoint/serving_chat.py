"""POST /v1/chat/completions: a transcript of messages, answered with the model's chat template."""

from __future__ import annotations

from infemeral.client.sampling import SamplingParams
from infemeral.endpoint.schema import ChatCompletionRequest
from infemeral.endpoint.serving import OpenAIServing


class ServingChat(OpenAIServing):
    kind = "chat"
    name = "chat completion"

    def prompt(self, body: ChatCompletionRequest, params: SamplingParams):
        messages = body.template_messages()
        return self.client.chat_ids(messages), lambda session: session.stream_messages(messages, params), ""
