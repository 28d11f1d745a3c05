"""Many requests at once: continuous batching, tau policies, the app's live shared batch, seeded replays."""
