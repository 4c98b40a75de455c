"""The gRPC front door (grpc.aio): ``servicer.GrpcDoor``, ``security`` (API keys, TLS) and
``convert`` (proto <-> the router core's types). Nothing is imported here, so that the package
can be named without loading grpc."""
