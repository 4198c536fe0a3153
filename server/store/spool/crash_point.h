// Named crash points for the crash tests: with the environment variable
// KVRELAY_CRASH_POINT=NAME (or NAME:N) the process kills itself with
// SIGKILL the first (N-th) time it reaches CrashPoint("NAME"), exactly as a
// kill -9 at that instant would. Unset (production), each call is one
// relaxed atomic load.
//
// The points (docs/SPOOL.md):
//   spool.message.after_temp_write   a message file written and synced under its temporary name
//   spool.message.before_rename      about to rename it into place
//   spool.message.after_rename       renamed, the directory not yet synced
//   spool.journal.after_append       records written to the journal, not yet synced
//   forward.mid_stream               a forward has sent its header and some layers, not its commit
//
// Thread-safe.
#ifndef KVRELAY_SERVER_STORE_SPOOL_CRASH_POINT_H_
#define KVRELAY_SERVER_STORE_SPOOL_CRASH_POINT_H_

namespace kvrelay {

void CrashPoint(const char* name);

}  // namespace kvrelay

#endif  // KVRELAY_SERVER_STORE_SPOOL_CRASH_POINT_H_
