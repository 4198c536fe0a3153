#include "server/rpc/request_checks.h"

#include <algorithm>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/quant.h"
#include "core/status_macros.h"

namespace kvrelay {

absl::Status CheckPolicyLength(const std::string& policy, const std::string& field) {
  if (policy.size() <= kMaxSpecBytes) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(field, ": ", policy.size(), " bytes, expected at most ", kMaxSpecBytes));
}

absl::Status CheckPolicyFor(const Pipeline& p, const TurnGeometry& geo, const std::string& field) {
  if (absl::Status s = p.CheckLayerwise(); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": ", s.message()));
  }
  if (absl::Status s = p.CheckHeadDim(geo.head_dim); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": ", s.message()));
  }
  if (absl::Status s = p.CheckWindow(geo); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": ", s.message(),
                                                   " (header.geometry.query_dtype is unset)"));
  }
  return absl::OkStatus();
}

double UploadWork(const Pipeline& p, const TurnGeometry& geo, int layers, bool first_agent) {
  // A softmax weight (its exponential, the sums and the mass it adds), in
  // multiply-adds: what it costs on one core next to the GEMMs' FMAs, as
  // measured on a layer of head_dim 1 and a Qwen3-14B layer.
  constexpr double kExp = 96;
  const double d = geo.head_dim, score_heads = geo.score_heads, n_gen = geo.n_gen;
  const double keys = static_cast<double>(geo.n_history) + geo.n_prompt + geo.n_gen;
  Message counts;
  p.CountTokens(geo, first_agent, &counts);
  double layer = 0;
  if (geo.queries) {
    const int window = p.config().select.window;
    const double steps = window > 0 ? std::min(window, geo.n_gen) : geo.n_gen;
    layer += score_heads * steps * keys * (d + kExp);
    const double msg_keys = static_cast<double>(counts.n_history) + counts.n_anchor + counts.n_kept + counts.n_gen;
    layer += score_heads * n_gen * (keys + msg_keys) * (2 * d + kExp);
  }
  if (p.config().obf && counts.n_kept > 0) {
    const double n_cand = geo.n_prompt - counts.n_anchor;
    layer += static_cast<double>(geo.kv_heads) * (n_cand * d * d + d * d * d);
  }
  return layer * layers;
}

absl::Status CheckUploadWork(const Pipeline& p, const TurnGeometry& geo, int layers, bool first_agent,
                             double limit) {
  KVRELAY_RETURN_IF_ERROR(CheckQueryScoreWork(geo, "layer.0.gen.q"));
  const double work = UploadWork(p, geo, layers, first_agent);
  if (work <= limit) return absl::OkStatus();
  return absl::ResourceExhaustedError(absl::StrFormat(
      "header.geometry: compressing %d layers with '%s' takes about %.4g multiply-adds (%s), expected at most "
      "--max-upload-work=%.4g; the request alone is over the limit, so retrying cannot succeed (send fewer "
      "layers or tokens, prompt.score instead of gen.q, or a policy without obf)",
      layers, p.spec(), work,
      !geo.queries ? "obf" : p.config().obf ? "scoring from gen.q, the fidelity figure and obf"
                                            : "scoring from gen.q and the fidelity figure",
      limit));
}

}  // namespace kvrelay
