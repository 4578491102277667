"""The OpenAI-compatible HTTP server: app, protocol models, routes, errors, auth, limits."""
