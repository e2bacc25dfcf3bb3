"""The gRPC face of the engine: one bidirectional stream per turn.

Handlers translate messages to engine calls and StatusErrors to gRPC statuses.
A stream that ends, is cancelled or fails before its commit message leaves the
stored session exactly as it was: the engine only writes on commit.
"""

from __future__ import annotations

import logging
import time

import grpc

from infemeral import __version__
from infemeral.cloak.bundle import dtype_name
from infemeral.errors import InvalidArgument, StatusError
from infemeral.protocol import PROTOCOL_VERSION, pb, pb_grpc
from infemeral.protocol.tensors import from_proto, to_proto
from infemeral.server.engine import Engine
from infemeral.storage.base import store_errors

log = logging.getLogger(__name__)
STORE_ERRORS = store_errors()


class InfemeralService(pb_grpc.InfemeralServicer):
    def __init__(self, engine: Engine, max_message_bytes: int):
        self.engine = engine
        self.max_message_bytes = max_message_bytes

    def Turn(self, request_iterator, context):
        turn, outcome = None, "abandoned"
        try:
            first = next(request_iterator, None)
            if first is None or first.WhichOneof("kind") != "open":
                raise InvalidArgument("a turn must start with an `open` message")
            o = first.open
            turn = self.engine.open_turn(o.session_id, o.session_key, o.expected_version, o.bundle_fingerprint,
                                         o.turn_id, o.pending_turn_id, o.reserve_tokens)
            yield pb.TurnResponse(opened=pb.Opened(version=turn.version, cache_length=turn.cache.length,
                                                   pending_committed=turn.version == o.expected_version + 1))
            for req in request_iterator:
                kind = req.WhichOneof("kind")
                if kind == "step":
                    started = time.perf_counter()
                    hidden = from_proto(req.step.hidden, self.engine.hidden_size, self.engine.max_step_tokens)
                    out = self.engine.step(turn, hidden, req.step.cache_length, req.step.outputs, req.step.evict)
                    self.engine.metrics.step_answered(time.perf_counter() - started)
                    yield pb.TurnResponse(step=pb.StepResult(hidden=to_proto(out.hidden.to(hidden.dtype)),
                                                             cache_length=out.cache_length,
                                                             evicted=out.num_evicted))
                elif kind == "truncate":
                    length = self.engine.truncate(turn, req.truncate.tokens, req.truncate.cache_length)
                    yield pb.TurnResponse(truncated=pb.Truncated(cache_length=length))
                elif kind == "commit":
                    version = self.engine.commit(turn)
                    outcome = "committed"
                    length = turn.cache.length
                    self.engine.close_turn(turn)  # release the session before the client hears "committed"
                    yield pb.TurnResponse(committed=pb.Committed(version=version, cache_length=length))
                    return
                else:
                    raise InvalidArgument(f"unexpected message {kind!r} inside a turn")
        except StatusError as e:
            outcome = e.code.name.lower()
            retry_after = getattr(e, "retry_after", None)
            if retry_after:  # a hint clients and proxies can act on
                context.set_trailing_metadata((("retry-after-ms", str(int(retry_after * 1000))),))
            context.abort(e.code, e.message)
        except STORE_ERRORS as e:
            outcome = "store_error"
            self.engine.metrics.store_failed()
            log.error("store error: %s", type(e).__name__)
            context.abort(grpc.StatusCode.UNAVAILABLE, "session store is unavailable; the session is unchanged, retry")
        finally:
            if turn is not None:
                self.engine.close_turn(turn)
            self.engine.metrics.turn_ended(outcome)

    def GetServerInfo(self, request, context):
        e = self.engine
        return pb.ServerInfo(
            bundle_fingerprint=e.bundle.fingerprint, model_type=e.bundle.config.model_type,
            hidden_size=e.hidden_size, first_layer=e.bundle.first_layer, num_layers=e.bundle.num_layers,
            total_layers=e.bundle.config.num_hidden_layers, dtype=dtype_name(e.dtype), device=str(e.device),
            max_step_tokens=e.max_step_tokens, max_context=e.window.max_context, window=e.window.enabled,
            sink_tokens=e.window.sink_tokens, page_size=e.window.page_size,
            max_message_bytes=self.max_message_bytes, server_version=__version__,
            protocol_version=PROTOCOL_VERSION)

    def DeleteSession(self, request, context):
        try:
            self.engine.delete_session(request.session_id, request.session_key)
        except StatusError as e:
            context.abort(e.code, e.message)
        except STORE_ERRORS as e:
            log.error("store error: %s", type(e).__name__)
            context.abort(grpc.StatusCode.UNAVAILABLE, "session store is unavailable; retry")
        return pb.DeleteSessionResponse()
