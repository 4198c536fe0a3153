// Where each agent's mailbox lives: on this relay, or on another relay of
// the mesh that publishes to it are forwarded to.
//
// Three sources, highest precedence first:
//   - static routes (--route AGENT=TARGET);
//   - the route file (--route-file FILE): a JSON object {AGENT: TARGET},
//     re-read when its content changes (a ConfigMap update takes effect
//     without a restart; a bad file keeps the last good table and logs why);
//   - the template (--route-template, e.g.
//     "dns:///{agent}.kvrelay.agents.svc.cluster.local:50051"), which only
//     names agents that form a valid DNS label.
// An agent no source names is local, and so is one whose target equals
// this relay's own --advertise target (compared as strings).
//
// Thread-safe. Resolve() never blocks on file I/O: the file is polled by a
// background thread that swaps in a new table.
#ifndef KVRELAY_SERVER_MESH_ROUTING_H_
#define KVRELAY_SERVER_MESH_ROUTING_H_

#include <chrono>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/mutex.h"
#include "core/time_source.h"
#include "server/config/route_template.h"
#include "server/config/watched_file.h"

namespace kvrelay {

struct RouteOptions {
  std::map<std::string, std::string> routes;  // agent -> target
  std::string route_file;                     // "": none
  std::string route_template;                 // "": none; contains "{agent}" once
  std::string advertise;                      // this relay's own target ("": none)
  // How often the route file is checked for changes.
  std::chrono::milliseconds poll_interval{1000};
  // The poller's time (not owned; outlives the table).
  TimeSource* time = TimeSource::Real();
};

// Parses a route file's content: a JSON object whose keys are agent ids
// and whose values are targets (both checked). InvalidArgument naming
// `source` and the offending key otherwise.
absl::StatusOr<std::map<std::string, std::string>> ParseRouteFile(const std::string& content,
                                                                  const std::string& source);

class RouteTable {
 public:
  // Reads the route file once (a missing or bad file at start-up is an
  // error naming --route-file) and starts polling it.
  static absl::StatusOr<std::unique_ptr<RouteTable>> Create(const RouteOptions& opts);
  ~RouteTable();  // stops the poller
  RouteTable(const RouteTable&) = delete;
  RouteTable& operator=(const RouteTable&) = delete;

  // The target of `agent`'s relay, or nullopt when its mailbox is here.
  // InvalidArgument naming `field` when only the template could route it
  // and `agent` is not a DNS label.
  absl::StatusOr<std::optional<std::string>> Resolve(const std::string& agent,
                                                     const std::string& field = "recipient") const;

  // Whether any source can route anywhere (false: every agent is local).
  bool enabled() const { return enabled_; }
  const std::string& advertise() const { return opts_.advertise; }

  // Checks the route file now (the poller calls this): OK when it was
  // loaded or its content is what was read last time (a bad content is
  // reported once, the first time it is read); the error otherwise, the
  // table staying as it was.
  absl::Status ReloadNow();
  // How many times the file's content was loaded, the start-up load included.
  uint64_t file_loads() const;
  // How many times the poller has read the route file.
  uint64_t file_polls() const;

 private:
  explicit RouteTable(const RouteOptions& opts);

  const RouteOptions opts_;
  const bool enabled_;
  mutable Mutex mu_;
  std::shared_ptr<const std::map<std::string, std::string>> file_routes_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<WatchedFile> file_;                                       // null: no route file
};

}  // namespace kvrelay

#endif  // KVRELAY_SERVER_MESH_ROUTING_H_
