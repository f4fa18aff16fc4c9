"""KV-aware routing: what every inference engine holds, from its KV cache events, and which
engine a prompt should go to (docs/routing.md)."""
