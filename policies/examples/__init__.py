"""Worked examples of custom policies (see the README, "Writing a policy")."""
