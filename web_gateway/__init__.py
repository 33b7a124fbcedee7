"""The stateless HTTP gateway (under construction: see the gateway issue)."""
