"""Generated from planner.proto by planner_service.proto_build; do not edit."""
PROTO_SHA256 = "5de1a6d9919d974e8f4e7e16c7b96e088f7c45e9bccbe4eee359ed1df69ad78f"
