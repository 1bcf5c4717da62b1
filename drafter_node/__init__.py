"""The edge drafter agent."""
