// The route template (--route-template): the target of an agent that no
// route names, written once with the placeholder "{agent}", which the
// agent's id replaces. Only agents whose ids are DNS labels can be routed
// by it.
#ifndef KVRELAY_SERVER_CONFIG_ROUTE_TEMPLATE_H_
#define KVRELAY_SERVER_CONFIG_ROUTE_TEMPLATE_H_

#include <string>

#include "absl/status/status.h"

namespace kvrelay {

// Whether `name` is a DNS label (RFC 1123): 1..63 letters, digits and '-',
// starting and ending with a letter or digit.
bool IsDnsLabel(const std::string& name);

// OK for a gRPC target with the placeholder "{agent}" exactly once, which
// stays a target once any DNS label replaces it; otherwise InvalidArgument
// whose message is what was expected ("a target with the placeholder
// {agent} exactly once, e.g. ...").
absl::Status CheckRouteTemplate(const std::string& tmpl);

// `tmpl` with its placeholder replaced by `agent`.
// REQUIRES: CheckRouteTemplate(tmpl) is OK.
std::string ExpandRouteTemplate(const std::string& tmpl, const std::string& agent);

}  // namespace kvrelay

#endif  // KVRELAY_SERVER_CONFIG_ROUTE_TEMPLATE_H_
