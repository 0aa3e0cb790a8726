"""``fastdeploy router``: an OpenAI-compatible front for prefill/decode pairs or plain replicas."""
