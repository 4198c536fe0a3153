#include "server/mesh/routing.h"

#include <fstream>
#include <set>
#include <sstream>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "core/ids.h"
#include "core/mutex.h"
#include "core/status_macros.h"
#include "nlohmann/json.hpp"
#include "proto/address.h"
#include "server/config/route_template.h"
#include "spdlog/spdlog.h"

namespace kvrelay {
absl::StatusOr<std::map<std::string, std::string>> ParseRouteFile(const std::string& content,
                                                                  const std::string& source) {
  // The parser keeps the last of keys given twice: note them as they pass.
  std::set<std::string> seen;
  std::string twice;
  auto note_keys = [&](int depth, nlohmann::json::parse_event_t event, nlohmann::json& parsed) {
    if (event == nlohmann::json::parse_event_t::key && depth == 1 && parsed.is_string() &&
        !seen.insert(parsed.get<std::string>()).second && twice.empty()) {
      twice = parsed.get<std::string>();
    }
    return true;
  };
  nlohmann::json j = nlohmann::json::parse(content, note_keys, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": not a JSON object, expected {\"AGENT\": \"TARGET\", ...}"));
  }
  if (!twice.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": key '", absl::CHexEscape(twice), "': given twice, expected each agent once"));
  }
  std::map<std::string, std::string> routes;
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string field = absl::StrCat(source, ": key '", absl::CHexEscape(it.key()), "'");
    if (absl::Status s = CheckId(field, it.key()); !s.ok()) return s;
    if (!it.value().is_string()) {
      return absl::InvalidArgumentError(absl::StrCat(field, ": ", it.value().type_name(),
                                                     ", expected a target string (HOST:PORT or dns:///HOST:PORT)"));
    }
    const std::string target = it.value().get<std::string>();
    if (absl::Status s = CheckGrpcTarget(target, field); !s.ok()) return s;
    routes.emplace(it.key(), target);
  }
  return routes;
}

RouteTable::RouteTable(const RouteOptions& opts)
    : opts_(opts),
      enabled_(!opts.routes.empty() || !opts.route_file.empty() || !opts.route_template.empty()),
      file_routes_(std::make_shared<std::map<std::string, std::string>>()) {}

absl::StatusOr<std::unique_ptr<RouteTable>> RouteTable::Create(const RouteOptions& opts) {
  std::unique_ptr<RouteTable> t(new RouteTable(opts));
  if (!opts.route_file.empty()) {
    RouteTable* p = t.get();
    KVRELAY_ASSIGN_OR_RETURN(
        t->file_, WatchedFile::Start(
                      "--route-file", opts.route_file, opts.poll_interval,
                      [p](const std::string& content) {
                        KVRELAY_ASSIGN_OR_RETURN(auto routes, ParseRouteFile(content, absl::StrCat("--route-file=",
                                                                                                  p->opts_.route_file)));
                        MutexLock lock(&p->mu_);
                        p->file_routes_ = std::make_shared<const std::map<std::string, std::string>>(std::move(routes));
                        return absl::OkStatus();
                      },
                      [p] {
                        MutexLock l(&p->mu_);
                        return absl::StrCat("the last good table (", p->file_routes_->size(), " routes)");
                      },
                      opts.time));
  }
  return t;
}

RouteTable::~RouteTable() = default;

absl::Status RouteTable::ReloadNow() { return file_ ? file_->ReloadNow() : absl::OkStatus(); }

uint64_t RouteTable::file_loads() const { return file_ ? file_->loads() : 0; }
uint64_t RouteTable::file_polls() const { return file_ ? file_->polls() : 0; }

absl::StatusOr<std::optional<std::string>> RouteTable::Resolve(const std::string& agent,
                                                               const std::string& field) const {
  if (!enabled_) return std::optional<std::string>();
  std::string target;
  if (auto it = opts_.routes.find(agent); it != opts_.routes.end()) {
    target = it->second;
  } else {
    std::shared_ptr<const std::map<std::string, std::string>> file;
    {
      MutexLock lock(&mu_);
      file = file_routes_;
    }
    if (auto f = file->find(agent); f != file->end()) {
      target = f->second;
    } else if (!opts_.route_template.empty()) {
      if (!IsDnsLabel(agent)) {
        return absl::InvalidArgumentError(absl::StrCat(
            field, ": '", absl::CHexEscape(agent), "' is not a DNS label (1..63 letters, digits and '-', not "
            "starting or ending with '-'), expected one for --route-template=", opts_.route_template,
            ", or a --route / --route-file entry for it"));
      }
      target = ExpandRouteTemplate(opts_.route_template, agent);
    }
  }
  if (target.empty() || (!opts_.advertise.empty() && target == opts_.advertise)) return std::optional<std::string>();
  return std::optional<std::string>(std::move(target));
}

}  // namespace kvrelay
