"""The pdserve proto package (mirrors the proto package path pdserve.v1)."""
