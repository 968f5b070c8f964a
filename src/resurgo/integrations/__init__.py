"""Adapters that put resurgo under the training frameworks users already have.

One module per framework (``resurgo.integrations.lightning``, ...). Each imports its framework,
so import the one you use; nothing in the core of resurgo imports this package.
"""
