"""Protocol definitions; see proto/pdserve/v1/router.proto."""
