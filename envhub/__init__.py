"""Environment servers over HTTP, wire-compatible with AgentGym's, with its defects fixed."""
