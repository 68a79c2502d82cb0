"""The one door between host and device: scheduled work -> padded arrays in shape buckets ->
one packed transfer each way -> the jitted step (KV pool donated)."""
from paxkv.runner.memory import profile_activation_bytes
from paxkv.runner.runner import Runner

__all__ = ["Runner", "profile_activation_bytes"]
