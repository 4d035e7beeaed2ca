from rest_framework.pagination import PageNumberPagination


class Pagination(PageNumberPagination):
    """Page-number pagination; clients may ask for up to 500 rows a page with ``page_size``."""

    page_size_query_param = "page_size"
    max_page_size = 500
