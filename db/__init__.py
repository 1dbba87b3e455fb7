"""The job database: schema, sessions, migrations and the job/token records."""

from db.schema import ApiToken, Base, Job, JobStatus, User
from db.session import Database

__all__ = ["ApiToken", "Base", "Database", "Job", "JobStatus", "User"]
