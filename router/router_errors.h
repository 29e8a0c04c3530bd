// Error answers shared by the router's two sides (router.cpp, router_api.cpp).
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "router/http_server.h"
#include "router/openai_api.h"

namespace pd::router {

// An OpenAI-style error; 5xx get the type their status implies unless one is given.
inline ApiError api_error(int status, std::string message, std::string param = "", std::string type = "") {
  ApiError e;
  e.status = status;
  e.message = std::move(message);
  e.param = std::move(param);
  if (!type.empty()) e.type = std::move(type);
  else if (status >= 500) e.type = status == 503 ? "service_unavailable" : "server_error";
  return e;
}

inline void respond_error(ResponseWriter& w, const ApiError& e,
                          std::vector<std::pair<std::string, std::string>> headers = {}) {
  w.respond(e.status, "application/json", error_body(e), std::move(headers));
}

}  // namespace pd::router
