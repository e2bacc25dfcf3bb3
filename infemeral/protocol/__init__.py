"""The wire protocol: generated gRPC stubs and tensor (de)serialisation."""

from infemeral.protocol.generated import infemeral_pb2 as pb
from infemeral.protocol.generated import infemeral_pb2_grpc as pb_grpc

PROTOCOL_VERSION = 1
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Infemeral"].full_name

__all__ = ["pb", "pb_grpc", "PROTOCOL_VERSION", "SERVICE_NAME"]
