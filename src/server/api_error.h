// The OpenAI error object and the HTTP status it travels with. Handlers throw ApiError for every
// client-caused failure (validation, unknown model, context overflow, queue full); anything else that
// escapes a handler becomes a generic 500 whose cause is only logged.
#pragma once
#include <nlohmann/json.hpp>

#include <stdexcept>
#include <string>

namespace kestrel::server {

struct ApiError : std::runtime_error {
  int status;
  std::string type;
  std::string param;  // empty = null
  std::string code;   // empty = null
  ApiError(int status_, std::string type_, std::string message, std::string param_ = {},
           std::string code_ = {})
      : std::runtime_error(std::move(message)), status(status_), type(std::move(type_)),
        param(std::move(param_)), code(std::move(code_)) {}
  nlohmann::json to_json() const {
    nlohmann::json e = {{"message", what()}, {"type", type}, {"param", nullptr}, {"code", nullptr}};
    if (!param.empty()) e["param"] = param;
    if (!code.empty()) e["code"] = code;
    return nlohmann::json{{"error", e}};
  }
};

// 400 invalid_request_error naming the offending parameter.
inline ApiError invalid(std::string message, std::string param = {}) {
  return ApiError(400, "invalid_request_error", std::move(message), std::move(param));
}

}  // namespace kestrel::server
