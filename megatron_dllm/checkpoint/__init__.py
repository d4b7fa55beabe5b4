"""Checkpoints on disk: layout (names, tracker, completion), manifests, and save/locate."""
from megatron_dllm.checkpoint import layout, manifest
from megatron_dllm.checkpoint.layout import TRACKER, Found, iteration_dir
from megatron_dllm.checkpoint.manifest import MANIFEST, CheckpointError, verify_manifest
from megatron_dllm.checkpoint.store import check_writable, locate, read, remove_incomplete, save

__all__ = ["layout", "manifest", "TRACKER", "MANIFEST", "CheckpointError", "Found", "iteration_dir", "verify_manifest",
           "check_writable", "locate", "read", "remove_incomplete", "save"]
