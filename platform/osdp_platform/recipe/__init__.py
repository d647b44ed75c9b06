"""The recipe: what a user may declare (schema), how YAML and overrides become one (loader), the reference
rendered from the schema (docs), and the mistakes found before anything starts (preflight)."""
