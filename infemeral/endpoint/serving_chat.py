"""POST /v1/chat/completions: a transcript of messages, answered with the model's chat template."""

from __future__ import annotations

from infemeral.client.sampling import SamplingParams
from infemeral.endpoint.conversations import Conversations
from infemeral.endpoint.schema import ChatCompletionRequest, RequestError
from infemeral.endpoint.serving import OpenAIServing


class ServingChat(OpenAIServing):
    kind = "chat"
    name = "chat completion"

    def __init__(self, pool, models, defaults: SamplingParams, conversations: Conversations | None = None):
        super().__init__(pool, models, defaults)
        self.conversations = conversations

    def lease(self, body: ChatCompletionRequest) -> dict:
        """A request that names a saved conversation continues its session and saves it after the answer."""
        if body.conversation is None:
            return {}
        if self.conversations is None:
            raise RequestError(400, "this endpoint keeps no conversations: leave out `conversation`",
                               param="conversation")
        return self.conversations.lease(body.conversation)

    def prompt(self, body: ChatCompletionRequest, params: SamplingParams):
        messages = body.template_messages()
        return self.client.chat_ids(messages), lambda session: session.stream_messages(messages, params), ""
