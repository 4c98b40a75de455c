"""pdserve.v1 protos. The *_pb2*.py stubs here are generated (pdserve.proto.stubs), not committed."""
