"""jinja2 templates for generated programs (shipped as package data)."""
