"""Generated from planner.proto by planner_service.proto_build; do not edit."""
PROTO_SHA256 = "71bb454e900d84e664e23ad060299d0f354ec7049e3c008044848bfc74d1f89b"
