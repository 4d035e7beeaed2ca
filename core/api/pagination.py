from rest_framework.exceptions import ValidationError
from rest_framework.pagination import PageNumberPagination


class Pagination(PageNumberPagination):
    """Page-number pagination; clients may ask for up to 500 rows a page with ``page_size``.

    A ``page`` or ``page_size`` that is not a whole number is a 400 (DRF would quietly use the first page or the
    default size instead); a ``page_size`` above 500 is served as 500, a page past the last is a 404.
    """

    page_size_query_param = "page_size"
    max_page_size = 500

    def get_page_size(self, request) -> int:
        raw = request.query_params.get(self.page_size_query_param)
        if raw is None:
            return self.page_size
        if not (raw.isascii() and raw.isdigit()) or int(raw) < 1:
            raise ValidationError({self.page_size_query_param: ["Must be a whole number of at least 1."]})
        return min(int(raw), self.max_page_size)

    def get_page_number(self, request, paginator):
        raw = request.query_params.get(self.page_query_param)
        if raw is not None and raw not in self.last_page_strings and not (raw.isascii() and raw.isdigit()):
            raise ValidationError({self.page_query_param: ["Must be a whole number of at least 1, or last."]})
        return super().get_page_number(request, paginator)

    def get_schema_operation_parameters(self, view) -> list[dict]:
        parameters = super().get_schema_operation_parameters(view)
        for parameter in parameters:
            parameter["schema"]["minimum"] = 1
        return parameters
