"""Shared utilities below every layer: atomic files, one-line errors, module hooks."""
