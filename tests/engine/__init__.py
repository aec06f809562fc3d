"""kvservice.engine's facades (the poll-style calls engines make from their scheduler threads):
over scripted doors and with real agents."""
