"""Structured output: grammars, tools, tool replies."""
