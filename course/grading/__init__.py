"""Grading and progress: how far an implementation has come (progress), its milestones run
chapter by chapter in subprocesses that survive a hanging or crashing engine (grade, with the
pytest plugin recorder), a class's gradebook over many checkouts (gradebook), GitHub
Classroom's autograding file (classroom), and deliberately broken engines that prove
grading survives them (faults)."""
