"""evaluate.py — avg@k, pass@k and maj@k on AIME24, AIME25, HMMT25, MATH500, AMC23 (not built yet: issue 6)."""

if __name__ == "__main__":
    raise SystemExit("evaluate.py is not built yet (issue 6).")
