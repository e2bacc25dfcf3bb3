"""What the chat page's "what the pod sees" panel shows: where the pod is, how the link to it is secured and
whether it forks sessions (GET /v1/pod), and what an operator with the public weights recovers of a
conversation's first message (POST /v1/conversations/{name}/audit: `infemeral.audit`, token by token).
"""

from __future__ import annotations

import threading

from infemeral.endpoint.conversations import Conversations
from infemeral.endpoint.schema import RequestError
from infemeral.endpoint.serving import speculate_modes
from infemeral.endpoint.session_pool import SessionPool
from infemeral.errors import StatusError

MAX_AUDIT_CHARS = 2000  # the audit's cost grows with the text: it is meant for one short message


class ServingPod:
    def __init__(self, pool: SessionPool, conversations: Conversations | None):
        self.pool, self.client, self.conversations = pool, pool.client, conversations
        self._auditing = threading.Lock()

    def describe(self) -> dict:
        """The pod as this endpoint reaches it (blocking: it may fetch the server's info)."""
        link = self.client.link
        view = {"address": self.client.address, "tls": link.tls, "mutual_tls": link.mutual_tls,
                "sent": ["hidden states in the secret basis", "the session's key, during each turn"],
                "never_sent": ["text", "token ids", "logits"],
                "speculate": speculate_modes(self.client)}
        try:
            info = self.client.server_info()
        except StatusError as e:
            return {**view, "reachable": False, "error": e.code.name, "fork": False}
        last = info.first_layer + info.num_layers - 1
        return {**view, "reachable": True, "server_version": info.server_version, "model_type": info.model_type,
                "fork": self.pool.pod_forks is not False,  # until the pod refused a fork as unknown to it
                "served_layers": f"{info.first_layer}-{last} of {info.total_layers}", "dtype": info.dtype,
                "device": info.device, "max_context": info.max_context}

    def audit(self, name: str) -> dict:
        """Run `audit` on the conversation's first message (blocking, seconds to a minute; one at a time): per
        token of it, whether each observer recovers it."""
        if self.conversations is None:
            raise RequestError(404, "this endpoint keeps no conversations", code="conversation_not_found")
        text, system = self.conversations.first_message(name)
        if len(text) > MAX_AUDIT_CHARS:
            raise RequestError(400, f"the first message is {len(text)} characters; the page audits messages of up "
                                    f"to {MAX_AUDIT_CHARS} (`infemeral-client audit` takes any length)", param="name")
        if not self._auditing.acquire(blocking=False):
            raise RequestError(429, "an audit is running already; try again when it has finished",
                               type="rate_limit_error", code="audit_running", headers={"Retry-After": "5"})
        try:
            from infemeral.audit import audit

            report = audit(text, self.client.bundle.directory, system=system)
        finally:
            self._auditing.release()
        return {"tokens": report.user_token_text, "seconds": round(report.seconds, 1), "verdict": report.verdict(),
                "rows": [{"key": row.key, "attack": row.attack, "observer": row.observer, "user_text": row.user_text,
                          "recovered": row.user_recovered} for row in report.rows if row.user_recovered is not None]}
