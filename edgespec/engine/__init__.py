"""The engine: a verification step over every active session (plan, take drafts, verify, commit),
the planning of draft lengths, the step's report, ``--auto``'s source choice, and one-process
generation (``edgespec.engine.local``) with its in-process drafter thread."""
