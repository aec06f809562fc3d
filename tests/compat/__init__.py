"""The previous release, built from the repository's history, beside this one: version negotiation
both ways."""
